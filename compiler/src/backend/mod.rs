//! Back ends: kernel IR to machine code.

pub mod cranelift;
pub mod x86;
