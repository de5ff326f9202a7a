"""Every launcher of conv-patch's Triton kernels (the ``conv_patch.kernels``
package, a namespace package: see conv_patch/__init__.py), in one module
that the torch-facing ops import on their first launch.

Importing it imports Triton and decorates the kernels; whether they run
through the interpreter is fixed then (``_launch.INTERPRET``), exactly as
Triton itself decides it at decoration time.
"""

from conv_patch.kernels.launch import INTERPRET, Program, Unrecordable, empty, recording  # noqa: F401
from conv_patch.kernels.conv2d import conv2d_fwd_kernel, launch_conv2d
from conv_patch.kernels.conv3d import conv3d_fwd_kernel, launch_conv3d
from conv_patch.kernels.conv3d_tma import conv3d_tma_kernel, conv3d_tma_problem, launch_conv3d_tma
from conv_patch.kernels.conv_transpose2d import conv_transpose2d_fwd_kernel, launch_conv_transpose2d
from conv_patch.kernels.conv2d_tma import conv2d_tma_kernel, launch_conv2d_tma, reads_nchw_in_place
from conv_patch.kernels.conv2d_taps import conv2d_tap_sum_kernel, launch_conv2d_taps
from conv_patch.kernels.conv2d_flat import conv2d_flat_kernel, launch_conv2d_flat
from conv_patch.kernels.layout import launch_nchw_to_nhwc, nchw_to_nhwc_kernel
from conv_patch.kernels.epilogue import epilogue_kernel, launch_epilogue
from conv_patch.kernels.group_norm import (group_norm_apply_nchw_kernel, group_norm_apply_nhwc_kernel,
                                           group_norm_finalize_kernel, group_norm_stats_kernel,
                                           group_norm_stats_nhwc_kernel, launch_group_norm, launch_group_norm_apply,
                                           launch_group_norm_partials, launch_group_norm_stats)
from conv_patch.kernels.rms_norm import launch_rms_norm, rms_norm_kernel
from conv_patch.kernels.softmax import launch_softmax_rows, softmax_rows_kernel
from conv_patch.kernels.attention import (attention_combine_kernel, attention_pv_kernel, attention_scores_kernel,
                                          launch_attention_block, partial_columns as attention_partial_columns)
from conv_patch.kernels.weight_prep import (grouped_pack_args, grouped_weight_pack_kernel,
                                            launch_grouped_weight_pack, launch_subpixel_fold, launch_weight_pack,
                                            subpixel_fold_kernel, weight_pack_kernel)

KERNELS = {
    "conv2d": conv2d_fwd_kernel,
    "conv_transpose2d": conv_transpose2d_fwd_kernel,
    "conv2d_tma": conv2d_tma_kernel,
    "conv2d_flat": conv2d_flat_kernel,
    "conv3d": conv3d_fwd_kernel,
    "conv3d_tma": conv3d_tma_kernel,
}
# The second stage of the few-output-channel route (the first is conv2d).
TAPS_KERNELS = {"conv2d_tap_sum": conv2d_tap_sum_kernel}

# Not convolutions; signatures of their own.
LAYOUT_KERNELS = {"nchw_to_nhwc": nchw_to_nhwc_kernel}
# The conv epilogue alone, after a cuDNN convolution.
EPILOGUE_KERNELS = {"epilogue": epilogue_kernel}
NORM_KERNELS = {"group_norm_stats": group_norm_stats_kernel, "group_norm_stats_nhwc": group_norm_stats_nhwc_kernel,
                "group_norm_finalize": group_norm_finalize_kernel, "group_norm_apply_nhwc": group_norm_apply_nhwc_kernel,
                "group_norm_apply_nchw": group_norm_apply_nchw_kernel, "rms_norm": rms_norm_kernel}
ATTENTION_KERNELS = {"softmax_rows": softmax_rows_kernel, "attention_scores": attention_scores_kernel,
                     "attention_combine": attention_combine_kernel, "attention_pv": attention_pv_kernel}
# Weight packs and the subpixel fold, refreshed at every call.
WEIGHT_KERNELS = {"weight_pack": weight_pack_kernel, "grouped_weight_pack": grouped_weight_pack_kernel,
                  "subpixel_fold": subpixel_fold_kernel}

__all__ = ["Program", "Unrecordable", "empty", "recording", "ATTENTION_KERNELS", "attention_partial_columns", "launch_attention_block", "EPILOGUE_KERNELS", "INTERPRET", "KERNELS", "LAYOUT_KERNELS", "NORM_KERNELS",
           "TAPS_KERNELS", "WEIGHT_KERNELS", "launch_conv2d", "launch_conv3d", "launch_conv3d_tma", "conv3d_tma_problem", "launch_conv2d_flat", "launch_conv2d_taps", "launch_conv2d_tma", "launch_conv_transpose2d", "reads_nchw_in_place",
           "launch_epilogue", "launch_group_norm", "launch_group_norm_apply", "launch_group_norm_partials",
           "launch_group_norm_stats",
           "launch_nchw_to_nhwc", "launch_rms_norm", "launch_softmax_rows", "launch_subpixel_fold", "launch_weight_pack",
           "grouped_pack_args", "launch_grouped_weight_pack"]
