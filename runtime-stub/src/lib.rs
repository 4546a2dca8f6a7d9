//! The runtime stub that models compiled by onnxc link against: shared C types, status
//! codes and hooks, `no_std` and allocation-free. Its contents arrive with the native
//! back end (see `shared/DESIGN.md`); nothing in it is used yet.
#![no_std]
