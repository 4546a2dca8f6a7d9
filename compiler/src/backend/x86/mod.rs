//! x86_64 machine code the compiler writes itself: Cranelift emits only 128-bit xmm code,
//! so the GEMM microkernels for AVX2 (ymm) and AVX-512 (zmm) are assembled here with
//! `iced-x86` and placed in the object as ordinary functions.

pub mod amx;
pub mod gemm;
pub mod wide;
pub mod wide_avx2;
