"""torch's private fake-tensor names that gpulab's shortcuts read (``torch/_subclasses/fake_tensor.py``
and the helpers its kernels use), and whether this torch has them in the shape read
(``SHORTCUTS``). Where it lacks them, each name is None and ``SHORTCUTS`` is False: ``FakeMode``
is then FakeTensorMode itself."""
from __future__ import annotations

import dataclasses
import inspect

from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["SHORTCUTS"]

try:   # FakeTensorMode's insides (torch/_subclasses/fake_tensor.py) and the helpers its kernels use
    from torch._prims_common import compute_elementwise_output_logical_to_physical_perm
    from torch._refs import _reshape_view_helper as reshape_view_helper
    from torch._subclasses.fake_tensor import (_DISPATCH_HANDLE_DIRECTLY, _DISPATCH_META_HANDLERS, SingletonConstant,
                                               _BypassDispatchCache, _DispatchCacheEntryOutputInfo, _DispatchCacheKey,
                                               _DispatchCacheValidEntry, _pin_device_index,
                                               in_kernel_invocation_manager)
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    from torch.utils._mode_utils import no_dispatch
    _IMPORTED = True
except ImportError:
    _IMPORTED = False
    SingletonConstant = _BypassDispatchCache = _DISPATCH_HANDLE_DIRECTLY = _DISPATCH_META_HANDLERS = _DispatchCacheEntryOutputInfo = _DispatchCacheKey = _DispatchCacheValidEntry = _pin_device_index = compute_elementwise_output_logical_to_physical_perm = get_proxy_mode = in_kernel_invocation_manager = no_dispatch = reshape_view_helper = None


def _shortcuts_supported() -> bool:
    """The private names FakeMode reads exist and have the fields and signatures it reads."""
    if not _IMPORTED:
        return False
    try:
        entry = {f.name for f in dataclasses.fields(_DispatchCacheValidEntry)}
        info = {f.name for f in dataclasses.fields(_DispatchCacheEntryOutputInfo)}
        key = list(inspect.signature(FakeTensorMode._cache_key).parameters)
        dispatch = list(inspect.signature(FakeTensorMode.dispatch).parameters)
    except (TypeError, ValueError):
        return False
    return ({"output_infos", "is_output_tuple"} <= entry
            and {"inplace_idx", "metadata", "view_idx", "constant_value"} <= info
            and key == ["self", "state", "func", "args", "kwargs"]
            and dispatch == ["self", "func", "types", "args", "kwargs"])


SHORTCUTS = _shortcuts_supported()

