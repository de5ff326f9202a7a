"""Every launcher of conv-patch's Triton kernels (the ``conv_patch.kernels``
package, a namespace package: see conv_patch/__init__.py), in one module
that the torch-facing ops import on their first launch
(``conv_patch.ops.loader.kernels``). The convolution routes' own launchers
are named by the route registry (``routing.registry.launcher_of``).

Importing it imports Triton and decorates the kernels; whether they run
through the interpreter is fixed then (``common.INTERPRET``), exactly as
Triton itself decides it at decoration time.
"""

from .attention import launch_attention_block, partial_columns as attention_partial_columns
from .cache_keys import fix_loaded as fix_cache_keys
from .common import INTERPRET
from .conv2d_tma import reads_nchw_in_place
from .depthwise import launch_depthwise
from .epilogue import launch_epilogue
from .group_norm import (launch_group_norm, launch_group_norm_apply, launch_group_norm_partials,
                                           launch_group_norm_stats)
from .grouped_pointwise import launch_grouped_pointwise
from .launch import (AheadProgress, Program, Unrecordable, compile_ahead, compiling_ahead, empty, hash_triton,
                     recording)
from .layout import launch_nchw_to_nhwc
from .rms_norm import launch_rms_norm
from .softmax import launch_softmax_rows
from .weight_prep import (grouped_pack_args, launch_grouped_weight_pack, launch_subpixel_fold,
                                            launch_weight_pack)

__all__ = ["INTERPRET", "AheadProgress", "Program", "Unrecordable", "attention_partial_columns", "compile_ahead",
           "compiling_ahead", "empty", "fix_cache_keys", "hash_triton",
           "grouped_pack_args", "launch_attention_block", "launch_depthwise", "launch_epilogue",
           "launch_grouped_pointwise", "launch_group_norm",
           "launch_group_norm_apply", "launch_group_norm_partials", "launch_group_norm_stats",
           "launch_grouped_weight_pack", "launch_nchw_to_nhwc", "launch_rms_norm", "launch_softmax_rows",
           "launch_subpixel_fold", "launch_weight_pack", "reads_nchw_in_place", "recording"]
