//! The transformation engine's allocator: mimalloc, for QuickJS only.
//!
//! **Why.** A run parses the webhook into many small JavaScript values and frees them all
//! at its end; with the C library's malloc, perf showed its bookkeeping (`_int_malloc`,
//! `malloc_consolidate`, `unlink_chunk`, `free`) at about a fifth of a transforming
//! worker's CPU (bench row 15). mimalloc (Microsoft's allocator, through the well-kept
//! `libmimalloc-sys` bindings) does the same work for a fraction of that. It serves only
//! QuickJS: as the process's global allocator it tripled the gateway's resident memory
//! (bench row 8: 22 to 61 MiB), which the rest of the gateway gains nothing for.
//!
//! QuickJS's memory limit still holds: the engine counts what it allocates through these
//! functions itself.

use std::ffi::c_void;

use libmimalloc_sys as mi;

/// QuickJS's allocations, served by mimalloc.
pub(super) struct MiMalloc;

// SAFETY: each function forwards to the mimalloc function of the same contract (memory
// aligned for any value, null on failure, `realloc`/`free` of a null pointer allowed, and
// `usable_size` of a pointer this allocator returned), which is what QuickJS expects of
// its malloc functions.
unsafe impl rquickjs::allocator::Allocator for MiMalloc {
    fn alloc(&mut self, size: usize) -> *mut u8 {
        // SAFETY: mi_malloc has no preconditions.
        unsafe { mi::mi_malloc(size).cast() }
    }

    fn calloc(&mut self, count: usize, size: usize) -> *mut u8 {
        // SAFETY: mi_calloc has no preconditions (it checks the product for overflow).
        unsafe { mi::mi_calloc(count, size).cast() }
    }

    unsafe fn dealloc(&mut self, ptr: *mut u8) {
        // SAFETY: QuickJS frees only what this allocator returned (or null).
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    unsafe fn realloc(&mut self, ptr: *mut u8, new_size: usize) -> *mut u8 {
        // SAFETY: QuickJS reallocates only what this allocator returned (or null).
        unsafe { mi::mi_realloc(ptr.cast::<c_void>(), new_size).cast() }
    }

    unsafe fn usable_size(ptr: *mut u8) -> usize {
        // SAFETY: QuickJS asks only about what this allocator returned (or null).
        unsafe { mi::mi_usable_size(ptr.cast::<c_void>().cast_const()) }
    }
}
