"""Two costs of Triton's interpreter that buy the tests nothing, cut
(``install``): the conftest installs them in the test process, and
``sitecustomize`` beside this file in every Python process the tests start
under the interpreter (the benchmarks' fresh child processes), where this
folder is on PYTHONPATH. Neither changes what a kernel computes or what a
test sees; each is applied only to the Triton code it was checked against
(read from its source), else nothing changes."""


def _interpreter_patches_the_language_once_per_launch():
    """Triton's interpreter patches ``triton.language`` (``_patch_lang``:
    ``inspect.getmembers`` over tl, tl.tensor, tl.math, ...) at every launch,
    for the launch, and again at every call of a ``@triton.jit`` helper
    inside a kernel (merge_moments, activate, ...), where the launch's patch
    is already in place: there it replaces nothing (a patched member is no
    longer a builtin) and re-sets the same stateless functions, and it was
    about a third of a Mochi GroupNorm's interpreted time. Here a helper
    called inside a launch whose patch covers its language modules runs
    without re-patching; anything else (a call outside a launch, the first
    call in a launch of a helper whose globals hold another triton.language
    module, such as Triton's own tl.sum's ``core``) takes Triton's own path,
    whose patch is then in place for the rest of the launch too.
    The kernels' arithmetic is untouched. Only the Triton interpreter this
    was written against (its code checked); else nothing changes."""
    import inspect

    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
        grid_call, device_call = ti.GridExecutor.__call__, ti.InterpretedFunction.__call__
        ok = ("patch_scope = _patch_lang(self.fn)" in inspect.getsource(grid_call)
              and "patch_scope.restore()" in inspect.getsource(grid_call)
              and "_patch_lang(self.fn)" in inspect.getsource(device_call)
              and "value in [tl, tl.core]" in inspect.getsource(ti._patch_lang))
    except Exception:
        return
    if not ok:
        return
    import threading

    class _Launches(threading.local):
        def __init__(self):
            self.stack = []  # this thread's launches in progress: the modules their patches cover

    langs_of, launches = {}, _Launches()

    def langs(fn):
        got = langs_of.get(fn)
        if got is None:
            got = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                           if inspect.ismodule(v) and v in (tl, tl.core))
        return got

    def launch(self, *args, **kwargs):
        active = launches.stack
        active.append(langs(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            active.pop()

    def helper(self, *args, **kwargs):
        got, active = langs(self.fn), launches.stack
        if not (got and active and got <= active[-1]):
            try:
                return device_call(self, *args, **kwargs)
            finally:
                # Its patch (never undone: Triton drops a helper's scope)
                # stays for the rest of the launch, as the launch's own does.
                if got and active:
                    active[-1] = active[-1] | got
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__, ti.InterpretedFunction.__call__ = launch, helper


def _interpreter_skips_the_overflow_check_it_never_asserts():
    """Triton's interpreter runs its integer-overflow sanitizer on every
    32-bit add, sub and mul (both operands cast to int64, the operation
    again, two comparisons, an and: about half a Wan decode's interpreted
    time), and hands the result to ``device_assert``, which returns
    without looking at it unless the interpreter's ``debug`` option is on;
    it is off (nothing here turns it on). With ``debug`` off the sanitizer
    is switched off too, so nothing the kernels compute or a test sees
    changes; with ``debug`` on it stays."""
    import dataclasses
    import inspect

    try:
        from triton.language import semantic
        from triton.runtime import interpreter as ti
        builder = ti.interpreter_builder
        sanitizer = inspect.getsource(semantic.TritonSemantic.binary_op_sanitize_overflow_impl)
        asserts = inspect.getsource(semantic.TritonSemantic.device_assert)
        ok = ("not self.builder.options.sanitize_overflow" in sanitizer and "self.device_assert(cond" in sanitizer
              and "if not self.builder.options.debug:\n            return" in asserts
              and not builder.options.debug)
        if ok:
            builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    except Exception:
        return


def install():
    _interpreter_patches_the_language_once_per_launch()
    _interpreter_skips_the_overflow_check_it_never_asserts()
