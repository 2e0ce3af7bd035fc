"""C++ sources of the XLA FFI attention route, and :mod:`npu_backend.ffi.build` which compiles them.

The Python side (loading, registering, ``ffi_attention``) is ``npu_backend._ffi``.
"""
