"""One-sided reads (UCX RMA) through the `ucp_*` C API, which ucxx 0.52's Python layer does not wrap.

ucxx's objects expose their raw handles (`UCXContext.handle`, `UCXEndpoint.handle`); this module calls libucp
(the library ucxx itself loaded) on them with ctypes. It does three things only:
- holder: register a memory range once (`ucp_mem_map`) and pack its remote key (`ucp_rkey_pack`);
- puller: unpack a peer's remote key for an endpoint (`ucp_ep_rkey_unpack`);
- puller: read a remote range into a local buffer (`ucp_get_nbx`), as a request the loop worker tracks like
  its tag requests (`completed`, `check_error()`).
No callbacks cross into Python: a request is polled with `ucp_request_check_status` and freed once done.
"""

from __future__ import annotations

import ctypes
import os

UCS_OK = 0
UCS_INPROGRESS = 1
_UCS_ERR_LAST = -100
_MEM_MAP_ADDRESS_LENGTH = (1 << 0) | (1 << 1)  # UCP_MEM_MAP_PARAM_FIELD_ADDRESS | _LENGTH
_MEM_MAP_MEMORY_TYPE = 1 << 4
_OP_ATTR_MEMORY_TYPE = 1 << 6
MEMORY_TYPE_HOST, MEMORY_TYPE_CUDA = 0, 1  # ucs_memory_type_t


def memory_type(cuda: bool) -> int:
    """Told to UCX up front, so it does not ask the driver for every buffer (ucxx turns its cache off)."""
    return MEMORY_TYPE_CUDA if cuda else MEMORY_TYPE_HOST


class _MemMapParams(ctypes.Structure):  # ucp_mem_map_params_t
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", ctypes.c_void_p),
    ]


class _RequestParam(ctypes.Structure):  # ucp_request_param_t
    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
    ]


_lib: ctypes.CDLL | None = None


def _ucp() -> ctypes.CDLL:
    """libucp as ucxx loaded it (the libucx wheel), with the signatures used here."""
    global _lib
    if _lib is None:
        import libucx

        path = os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so")
        lib = ctypes.CDLL(path if os.path.exists(path) else "libucp.so.0")
        p, sz, st = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        for name, args, res in [
            ("ucp_mem_map", [p, ctypes.POINTER(_MemMapParams), ctypes.POINTER(p)], st),
            ("ucp_mem_unmap", [p, p], st),
            ("ucp_rkey_pack", [p, p, ctypes.POINTER(p), ctypes.POINTER(sz)], st),
            ("ucp_rkey_buffer_release", [p], None),
            ("ucp_ep_rkey_unpack", [p, p, ctypes.POINTER(p)], st),
            ("ucp_rkey_destroy", [p], None),
            ("ucp_get_nbx", [p, p, sz, ctypes.c_uint64, p, ctypes.POINTER(_RequestParam)], p),
            ("ucp_request_check_status", [p], st),
            ("ucp_request_free", [p], None),
            ("ucs_status_string", [st], ctypes.c_char_p),
        ]:
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        _lib = lib
    return _lib


class RmaError(RuntimeError):
    pass


def _check(status: int, what: str) -> None:
    if status != UCS_OK:
        raise RmaError(f"{what}: {_ucp().ucs_status_string(status).decode()}")


class Registration:
    """A memory range registered with a UCX context, and its packed remote key (what a peer needs to read
    it). Unmapped by `close()`."""

    def __init__(self, context_handle: int, address: int, length: int, memory_type: int):
        lib = _ucp()
        params = _MemMapParams(
            field_mask=_MEM_MAP_ADDRESS_LENGTH | _MEM_MAP_MEMORY_TYPE,
            address=address,
            length=length,
            memory_type=memory_type,
        )
        self._context = ctypes.c_void_p(context_handle)
        self._memh = ctypes.c_void_p()
        _check(lib.ucp_mem_map(self._context, ctypes.byref(params), ctypes.byref(self._memh)), "ucp_mem_map")
        buf, size = ctypes.c_void_p(), ctypes.c_size_t()
        _check(lib.ucp_rkey_pack(self._context, self._memh, ctypes.byref(buf), ctypes.byref(size)), "ucp_rkey_pack")
        self.rkey = ctypes.string_at(buf, size.value)
        lib.ucp_rkey_buffer_release(buf)
        self.address, self.length = address, length

    def close(self) -> None:
        if self._memh:
            _ucp().ucp_mem_unmap(self._context, self._memh)
            self._memh = ctypes.c_void_p()


class RemoteKey:
    """A peer's packed remote key, unpacked for one endpoint. Destroyed by `close()` (before the endpoint)."""

    def __init__(self, ep_handle: int, packed: bytes):
        self._handle = ctypes.c_void_p()
        _check(
            _ucp().ucp_ep_rkey_unpack(ctypes.c_void_p(ep_handle), packed, ctypes.byref(self._handle)),
            "ucp_ep_rkey_unpack",
        )

    def close(self) -> None:
        if self._handle:
            _ucp().ucp_rkey_destroy(self._handle)
            self._handle = ctypes.c_void_p()


class GetRequest:
    """An RMA read in flight, shaped like ucxx's requests for the loop worker: `completed`, `check_error()`."""

    def __init__(
        self, ep_handle: int, address: int, length: int, remote_address: int, rkey: RemoteKey, memory_type: int
    ):
        lib = _ucp()
        param = _RequestParam(op_attr_mask=_OP_ATTR_MEMORY_TYPE, memory_type=memory_type)
        ptr = (
            lib.ucp_get_nbx(
                ctypes.c_void_p(ep_handle), address, length, remote_address, rkey._handle, ctypes.byref(param)
            )
            or 0
        )
        self._request = None
        self._status = UCS_OK
        if _UCS_ERR_LAST <= ctypes.c_int64(ptr).value < 0:  # UCS_PTR_IS_ERR: the status is the pointer
            self._status = ctypes.c_int64(ptr).value
        elif ptr:
            self._request = ctypes.c_void_p(ptr)
            self._status = UCS_INPROGRESS

    @property
    def completed(self) -> bool:
        if self._status == UCS_INPROGRESS:
            status = _ucp().ucp_request_check_status(self._request)
            if status != UCS_INPROGRESS:
                _ucp().ucp_request_free(self._request)
                self._request, self._status = None, status
        return self._status != UCS_INPROGRESS

    def check_error(self) -> None:
        if self._status not in (UCS_OK, UCS_INPROGRESS):
            raise RmaError(f"RMA read failed: {_ucp().ucs_status_string(self._status).decode()}")
