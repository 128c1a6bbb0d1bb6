//! DLPack export (the legacy `dltensor` capsule and the versioned `dltensor_versioned` one).
//! All of this crate's `unsafe` code lives here: the C structs of the DLPack ABI, the
//! capsule, and the deleters that hand memory back.
//!
//! Ownership: each exported tensor owns an `Arc` of the load it views (in `manager_ctx`).
//! That holds for CUDA loads too (`kDLCUDA` with the device's ordinal): the device memory is
//! freed (`cuMemFree`, which waits for work still using it) when the last view dies.
//! The consumer (torch, numpy) calls the deleter when its tensor dies; if the capsule is never
//! consumed, the capsule's destructor calls it. So the load's memory lives exactly as long as
//! the last tensor that views it, whoever frees last.

use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{c_void, CStr};
use std::sync::Arc;

const NAME: &CStr = c"dltensor";
const NAME_VERSIONED: &CStr = c"dltensor_versioned";

/// `kDLCPU`.
pub const DEVICE_CPU: i32 = 1;
/// `kDLCUDA`.
pub const DEVICE_CUDA: i32 = 2;

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

/// A DLPack element type: (code, bits).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDataType {
    /// kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLComplex 5, kDLBool 6.
    pub code: u8,
    /// Bits per element.
    pub bits: u8,
    /// Always 1.
    pub lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

const _: () = assert!(std::mem::size_of::<DLTensor>() == 48);
const _: () = assert!(std::mem::size_of::<DLManagedTensor>() == 64);
const _: () = assert!(std::mem::size_of::<DLManagedTensorVersioned>() == 80);

/// What an exported tensor keeps alive, and the arrays its DLTensor points into.
struct Context {
    _owner: Arc<dyn Send + Sync>,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

/// A tensor to export: `data` must stay valid while `owner` lives.
pub struct Export {
    /// Keeps the memory alive.
    pub owner: Arc<dyn Send + Sync>,
    /// First byte (a host pointer, or a device pointer for CUDA).
    pub data: *mut u8,
    /// `(device_type, device_id)`: `(DEVICE_CPU, 0)` or `(DEVICE_CUDA, ordinal)`.
    pub device: (i32, i32),
    /// Shape in elements of `dtype`.
    pub shape: Vec<i64>,
    /// Element type.
    pub dtype: DLDataType,
}

fn row_major_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// The two managed-tensor structs (legacy and versioned), for the generic deleters below.
trait Managed {
    /// The capsule name consumers look for.
    const NAME: &'static CStr;
    fn context(&self) -> *mut c_void;
    fn deleter(&self) -> Option<unsafe extern "C" fn(*mut Self)>;
}

impl Managed for DLManagedTensor {
    const NAME: &'static CStr = NAME;
    fn context(&self) -> *mut c_void {
        self.manager_ctx
    }
    fn deleter(&self) -> Option<unsafe extern "C" fn(*mut Self)> {
        self.deleter
    }
}

impl Managed for DLManagedTensorVersioned {
    const NAME: &'static CStr = NAME_VERSIONED;
    fn context(&self) -> *mut c_void {
        self.manager_ctx
    }
    fn deleter(&self) -> Option<unsafe extern "C" fn(*mut Self)> {
        self.deleter
    }
}

unsafe extern "C" fn delete<T: Managed>(p: *mut T) {
    if p.is_null() {
        return;
    }
    // SAFETY: p and its context were made by Box::into_raw in `capsule` and are freed only
    // here, once: the consumer calls the deleter exactly once, or the capsule destructor does
    // when nobody consumed the capsule (never both: consuming renames the capsule).
    unsafe {
        let m = Box::from_raw(p);
        drop(Box::from_raw(m.context() as *mut Context));
    }
}

unsafe extern "C" fn capsule_destructor<T: Managed>(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the GIL held on a capsule we created. A consumed capsule
    // has been renamed ("used_dltensor...") and IsValid is false: the consumer owns the tensor.
    // The error state is saved and restored because this can run while an exception is set.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, T::NAME.as_ptr()) == 1 {
            let mut ty = std::ptr::null_mut();
            let mut value = std::ptr::null_mut();
            let mut tb = std::ptr::null_mut();
            ffi::PyErr_Fetch(&mut ty, &mut value, &mut tb);
            let p = ffi::PyCapsule_GetPointer(capsule, T::NAME.as_ptr()) as *mut T;
            if let Some(d) = p.as_ref().and_then(|m| m.deleter()) {
                d(p);
            }
            ffi::PyErr_Restore(ty, value, tb);
        }
    }
}

/// Makes a DLPack capsule for `e`: versioned (DLPack 1.0, writable) when the consumer asked for
/// it with `max_version >= (1, 0)`, legacy otherwise.
pub fn capsule<'py>(py: Python<'py>, e: Export, versioned: bool) -> PyResult<Bound<'py, PyAny>> {
    let ndim =
        i32::try_from(e.shape.len()).map_err(|_| pyo3::exceptions::PyValueError::new_err("too many dimensions"))?;
    let strides = row_major_strides(&e.shape);
    let ctx = Box::into_raw(Box::new(Context { _owner: e.owner, shape: e.shape, strides }));
    // SAFETY: ctx is a valid, uniquely owned pointer from Box::into_raw; its vectors do not move
    // while it lives, so the DLTensor may point into them.
    let (shape_ptr, strides_ptr) = unsafe { ((*ctx).shape.as_mut_ptr(), (*ctx).strides.as_mut_ptr()) };
    let tensor = DLTensor {
        data: e.data as *mut c_void,
        device: DLDevice { device_type: e.device.0, device_id: e.device.1 },
        ndim,
        dtype: e.dtype,
        shape: shape_ptr,
        strides: strides_ptr,
        byte_offset: 0,
    };
    let (ptr, name, destructor): (*mut c_void, &CStr, unsafe extern "C" fn(*mut ffi::PyObject)) = if versioned {
        let m = Box::new(DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 0 },
            manager_ctx: ctx as *mut c_void,
            deleter: Some(delete::<DLManagedTensorVersioned>),
            flags: 0,
            dl_tensor: tensor,
        });
        (Box::into_raw(m) as *mut c_void, NAME_VERSIONED, capsule_destructor::<DLManagedTensorVersioned>)
    } else {
        let m = Box::new(DLManagedTensor {
            dl_tensor: tensor,
            manager_ctx: ctx as *mut c_void,
            deleter: Some(delete::<DLManagedTensor>),
        });
        (Box::into_raw(m) as *mut c_void, NAME, capsule_destructor::<DLManagedTensor>)
    };
    // SAFETY: the GIL is held (we have `py`); the name is a static C string that outlives the
    // capsule; on failure nothing took ownership of `ptr`, so we free it ourselves.
    unsafe {
        let cap = ffi::PyCapsule_New(ptr, name.as_ptr(), Some(destructor));
        if cap.is_null() {
            if versioned {
                delete(ptr as *mut DLManagedTensorVersioned);
            } else {
                delete(ptr as *mut DLManagedTensor);
            }
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, cap))
    }
}

/// Views `len` bytes at `addr` as a mutable slice.
///
/// # Safety
/// The memory must be valid for writes of `len` bytes for the lifetime `'a` and not accessed by
/// anything else meanwhile. The Python layer guarantees this for the addresses it passes: they
/// are `data_ptr()`s of contiguous CPU tensors (or shared-memory buffers) it checked and holds
/// references to for the whole call.
pub unsafe fn host_slice_mut<'a>(addr: usize, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: guaranteed by the caller, see above.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}

/// Views `len` bytes at `addr` as a slice.
///
/// # Safety
/// As for [`host_slice_mut`], for reads.
pub unsafe fn host_slice<'a>(addr: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_are_row_major() {
        assert_eq!(row_major_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(row_major_strides(&[]), Vec::<i64>::new());
        assert_eq!(row_major_strides(&[0, 5]), vec![5, 1]);
    }
}
