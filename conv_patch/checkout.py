"""How the package sits in a checkout: kernels/, recipes/ and configs/ are
sub-packages of conv_patch (pyproject.toml installs them as
conv_patch.kernels, .recipes and .configs) that lie beside conv_patch/ there
(conv_patch/__init__.py finds them), without __init__.py, so that Python
started in the checkout's root never takes them for top-level packages (a
top-level ``kernels`` would hide Hugging Face's, which transformers imports).
From there they are at most namespace portions; ``refuse_top_level`` keeps
their modules from loading under those names all the same."""


def refuse_top_level(module: str) -> None:
    """Raise ImportError where ``module``, a module of kernels/ or recipes/,
    is being imported under a top-level name: it is conv_patch's, and must
    not load twice under two names. Called by the modules every other one of
    those packages imports first."""
    if module.partition(".")[0] != "conv_patch":
        raise ImportError(f"{module} is conv-patch's conv_patch.{module}: import that one")
