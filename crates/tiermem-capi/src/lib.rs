//! The C API of tiermem: `libtiermem.so` / `libtiermem.a` with the hand-written header
//! `include/tiermem.h`, which documents every function.
//!
//! Conventions:
//! - every entry point checks its pointer arguments for NULL and returns an error instead of
//!   crashing; errors are NULL / -1 plus a thread-local message read with `tiermem_last_error`;
//! - every entry point runs under `catch_unwind`, so a panic becomes an error return instead of
//!   unwinding into C (in a `panic = "abort"` build a panic still aborts the process);
//! - `tiermem_engine_free` frees the engine's remaining regions first (unregistering and
//!   unmapping them); their handles stay valid until `tiermem_region_free`, which then only frees
//!   the handle.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tiermem_engine::{Engine, PinGuard, Region};

pub mod options;

/// A region slot shared by its C handle and its engine: `None` once the region was freed.
type RegionSlot = Mutex<Option<Region>>;

/// What `tiermem_engine *` points to.
#[derive(Debug)]
pub struct EngineHandle {
    /// Live regions, so `tiermem_engine_free` can free the ones the caller left behind before the
    /// engine's threads stop (a region registered with a userfaultfd nobody serves would hang
    /// any access to it).
    regions: Mutex<Vec<Weak<RegionSlot>>>,
    engine: Engine,
}

/// What `tiermem_region *` points to.
#[derive(Debug)]
pub struct RegionHandle {
    slot: Arc<RegionSlot>,
}

/// What `tiermem_pin *` points to.
#[derive(Debug)]
pub struct PinHandle {
    _guard: PinGuard,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: impl Into<String>) {
    let mut bytes = message.into().into_bytes();
    bytes.retain(|&b| b != 0);
    let text = CString::new(bytes).unwrap_or_default();
    // try_with: during thread exit (a C destructor calling in) the slot may be gone already,
    // and a panic here would cross into C.
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = text);
}

/// Run `body`, turning an error or a panic into `on_error` plus a last-error message.
fn ffi<T>(what: &str, on_error: T, body: impl FnOnce() -> Result<T, String>) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(value)) => value,
        Ok(Err(message)) => {
            set_last_error(format!("{what}: {message}"));
            on_error
        }
        Err(panic) => {
            let detail = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(format!("{what}: internal error (panic): {detail}"));
            on_error
        }
    }
}

fn non_null<T>(ptr: *const T, name: &str) -> Result<(), String> {
    if ptr.is_null() {
        Err(format!("argument `{name}` is NULL"))
    } else {
        Ok(())
    }
}

/// See `tiermem.h`.
#[no_mangle]
pub extern "C" fn tiermem_last_error() -> *const c_char {
    // The pointer stays valid until this thread's message is next replaced; during thread exit,
    // when the slot may be gone, an empty message.
    LAST_ERROR.try_with(|e| e.borrow().as_ptr()).unwrap_or(c"".as_ptr())
}

/// See `tiermem.h`.
///
/// # Safety
/// `options` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tiermem_engine_new(options: *const c_char) -> *mut EngineHandle {
    ffi("tiermem_engine_new", std::ptr::null_mut(), || {
        non_null(options, "options")?;
        // SAFETY: non-NULL, and the caller promises a NUL-terminated string.
        let text = unsafe { CStr::from_ptr(options) };
        let text = text.to_str().map_err(|_| "options are not UTF-8".to_string())?;
        let opts = options::parse(text).map_err(|e| e.to_string())?;
        let device = opts.device.open(opts.device_size).map_err(|e| format!("opening device {}: {e}", opts.device))?;
        let engine = Engine::new(opts.config, device).map_err(|e| e.to_string())?;
        Ok(Box::into_raw(Box::new(EngineHandle { regions: Mutex::new(Vec::new()), engine })))
    })
}

/// See `tiermem.h`.
///
/// # Safety
/// `engine` is NULL or a pointer from `tiermem_engine_new` not yet freed.
#[no_mangle]
pub unsafe extern "C" fn tiermem_engine_free(engine: *mut EngineHandle) {
    ffi("tiermem_engine_free", (), || {
        if engine.is_null() {
            return Ok(());
        }
        // SAFETY: the caller gives up a live pointer from `tiermem_engine_new`.
        let handle = unsafe { Box::from_raw(engine) };
        // Regions first: dropping one waits for its I/O, which needs the engine's threads.
        for slot in lock(&handle.regions).drain(..).filter_map(|w| w.upgrade()) {
            lock(&slot).take();
        }
        drop(handle);
        Ok(())
    })
}

/// See `tiermem.h`.
///
/// # Safety
/// `engine` is NULL or a live engine pointer.
#[no_mangle]
pub unsafe extern "C" fn tiermem_region_new(engine: *mut EngineHandle, len: usize) -> *mut RegionHandle {
    ffi("tiermem_region_new", std::ptr::null_mut(), || {
        non_null(engine, "engine")?;
        // SAFETY: non-NULL and live per the caller; only shared access is taken.
        let handle = unsafe { &*engine };
        let region = handle.engine.create_region(len).map_err(|e| e.to_string())?;
        let slot = Arc::new(Mutex::new(Some(region)));
        let mut regions = lock(&handle.regions);
        regions.retain(|w| w.strong_count() > 0);
        regions.push(Arc::downgrade(&slot));
        Ok(Box::into_raw(Box::new(RegionHandle { slot })))
    })
}

/// See `tiermem.h`.
///
/// # Safety
/// `region` is NULL or a live region pointer.
#[no_mangle]
pub unsafe extern "C" fn tiermem_region_ptr(region: *const RegionHandle) -> *mut c_void {
    ffi("tiermem_region_ptr", std::ptr::null_mut(), || {
        non_null(region, "region")?;
        // SAFETY: non-NULL and live per the caller.
        let handle = unsafe { &*region };
        let slot = lock(&handle.slot);
        let region = slot.as_ref().ok_or("the region's engine was freed")?;
        Ok(region.as_ptr().cast())
    })
}

/// See `tiermem.h`.
///
/// # Safety
/// `region` is NULL or a live region pointer.
#[no_mangle]
pub unsafe extern "C" fn tiermem_region_len(region: *const RegionHandle) -> usize {
    ffi("tiermem_region_len", 0, || {
        non_null(region, "region")?;
        // SAFETY: non-NULL and live per the caller.
        let handle = unsafe { &*region };
        let slot = lock(&handle.slot);
        Ok(slot.as_ref().ok_or("the region's engine was freed")?.len())
    })
}

/// See `tiermem.h`.
///
/// # Safety
/// `region` is NULL or a pointer from `tiermem_region_new` not yet freed.
#[no_mangle]
pub unsafe extern "C" fn tiermem_region_free(region: *mut RegionHandle) {
    ffi("tiermem_region_free", (), || {
        if region.is_null() {
            return Ok(());
        }
        // SAFETY: the caller gives up a live pointer from `tiermem_region_new`.
        let handle = unsafe { Box::from_raw(region) };
        // Dropped under the lock, so an engine being freed concurrently waits for it.
        lock(&handle.slot).take();
        Ok(())
    })
}

/// Advice values of `tiermem_region_advise` (see `tiermem.h`).
pub const TIERMEM_ADVICE_WILLNEED: c_int = 1;
/// See [`TIERMEM_ADVICE_WILLNEED`].
pub const TIERMEM_ADVICE_SEQUENTIAL: c_int = 2;
/// See [`TIERMEM_ADVICE_WILLNEED`].
pub const TIERMEM_ADVICE_COLD: c_int = 3;

/// See `tiermem.h`.
///
/// # Safety
/// `region` is NULL or a live pointer from `tiermem_region_new`.
#[no_mangle]
pub unsafe extern "C" fn tiermem_region_advise(
    region: *const RegionHandle,
    offset: usize,
    len: usize,
    advice: c_int,
) -> c_int {
    ffi("tiermem_region_advise", -1, || {
        non_null(region, "region")?;
        let advice = match advice {
            TIERMEM_ADVICE_WILLNEED => tiermem_engine::Advice::WillNeed,
            TIERMEM_ADVICE_SEQUENTIAL => tiermem_engine::Advice::Sequential,
            TIERMEM_ADVICE_COLD => tiermem_engine::Advice::Cold,
            other => {
                return Err(format!("unknown advice {other}: expected TIERMEM_ADVICE_WILLNEED, _SEQUENTIAL or _COLD"))
            }
        };
        // SAFETY: non-NULL and live per the caller.
        let handle = unsafe { &*region };
        let slot = lock(&handle.slot);
        let region = slot.as_ref().ok_or("the region's engine was freed")?;
        region.advise(offset, len, advice).map_err(|e| e.to_string())?;
        Ok(0)
    })
}

/// See `tiermem.h`.
///
/// # Safety
/// `engine` is NULL or a live engine pointer; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tiermem_prepare_kernel_access(
    engine: *mut EngineHandle,
    addr: *const c_void,
    len: usize,
    write: c_int,
    out: *mut *mut PinHandle,
) -> c_int {
    ffi("tiermem_prepare_kernel_access", -1, || {
        non_null(out, "out")?;
        // SAFETY: `out` is non-NULL and writable per the caller.
        unsafe { out.write(std::ptr::null_mut()) };
        non_null(engine, "engine")?;
        non_null(addr, "addr")?;
        if len == 0 {
            return Err("`len` must be greater than zero".into());
        }
        // SAFETY: non-NULL and live per the caller.
        let handle = unsafe { &*engine };
        let guard = handle.engine.prepare_kernel_access(addr.cast(), len, write != 0).map_err(|e| e.to_string())?;
        let pin = Box::into_raw(Box::new(PinHandle { _guard: guard }));
        // SAFETY: as above.
        unsafe { out.write(pin) };
        Ok(0)
    })
}

/// See `tiermem.h`.
///
/// # Safety
/// `pin` is NULL or a pointer from `tiermem_prepare_kernel_access` not yet released.
#[no_mangle]
pub unsafe extern "C" fn tiermem_pin_release(pin: *mut PinHandle) {
    ffi("tiermem_pin_release", (), || {
        if !pin.is_null() {
            // SAFETY: the caller gives up a live pin pointer.
            drop(unsafe { Box::from_raw(pin) });
        }
        Ok(())
    })
}

/// See `tiermem.h`.
///
/// # Safety
/// `engine` is NULL or a live engine pointer.
#[no_mangle]
pub unsafe extern "C" fn tiermem_stats_json(engine: *const EngineHandle) -> *mut c_char {
    ffi("tiermem_stats_json", std::ptr::null_mut(), || {
        non_null(engine, "engine")?;
        // SAFETY: non-NULL and live per the caller.
        let handle = unsafe { &*engine };
        let json = serde_json::to_string(&handle.engine.stats()).map_err(|e| e.to_string())?;
        // JSON escapes control characters, so it holds no NUL.
        Ok(CString::new(json).map_err(|e| e.to_string())?.into_raw())
    })
}

/// See `tiermem.h`.
///
/// # Safety
/// `s` is NULL or a string from this library not yet freed.
#[no_mangle]
pub unsafe extern "C" fn tiermem_string_free(s: *mut c_char) {
    ffi("tiermem_string_free", (), || {
        if !s.is_null() {
            // SAFETY: the caller gives up a string made by `CString::into_raw` here.
            drop(unsafe { CString::from_raw(s) });
        }
        Ok(())
    })
}

/// See `tiermem.h`.
///
/// # Safety
/// `engine` is NULL or a live engine pointer; `buf` is NULL or has `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn tiermem_engine_describe(engine: *const EngineHandle, buf: *mut c_char, len: usize) -> c_int {
    ffi("tiermem_engine_describe", -1, || {
        non_null(engine, "engine")?;
        if buf.is_null() && len != 0 {
            return Err("argument `buf` is NULL but `len` is not zero".into());
        }
        // SAFETY: non-NULL and live per the caller.
        let handle = unsafe { &*engine };
        let text = handle.engine.describe();
        let bytes = text.as_bytes();
        let full = c_int::try_from(bytes.len()).map_err(|_| "description too long".to_string())?;
        if len > 0 {
            let n = bytes.len().min(len - 1);
            let end = buf.wrapping_add(n);
            // SAFETY: `buf` is non-NULL (checked above since len > 0) and has `len` writable
            // bytes per the caller, maybe uninitialised (so written through the pointer, never
            // made a slice); `n < len` bytes are copied from `bytes`, which is ours.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), n) };
            // SAFETY: byte `n < len` of the caller's buffer.
            unsafe { end.write(0) };
        }
        Ok(full)
    })
}
