//! Back ends: kernel IR to machine code.

pub mod cranelift;
