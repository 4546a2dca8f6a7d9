fn main() {
    onnxc::Build::new()
        .model("../digits/model.onnx")
        .name("digits")
        .compile()
        .expect("onnxc compiles the digit classifier");
}
