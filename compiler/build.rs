//! Generates the ONNX protobuf message types from the vendored `.proto` files with
//! `protox` (a pure-Rust protobuf compiler), so building needs no `protoc`.
fn main() {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(["onnx/onnx-data.proto"], ["proto"])
        .expect("vendored onnx .proto files compile");
    prost_build::Config::new()
        .compile_fds(fds)
        .expect("prost code generation");
}
