//! Classifies the three bundled held-out digits with the model `build.rs` compiled.

mod digits {
    include!(concat!(env!("OUT_DIR"), "/digits.rs"));
}

/// Reads the 64 floats of one of the bundled `.npy` images (after its 128-byte header).
fn load(label: u32) -> [f32; digits::INPUT_0_ELEMS] {
    let path = format!("{}/../digits/digit_{label}.npy", env!("CARGO_MANIFEST_DIR"));
    let bytes = std::fs::read(&path).expect("bundled image");
    let mut x = [0f32; digits::INPUT_0_ELEMS];
    for (i, c) in bytes[128..].chunks_exact(4).enumerate() {
        x[i] = f32::from_le_bytes(c.try_into().unwrap());
    }
    x
}

fn main() {
    if !digits::cpu_supported() {
        eprintln!("this CPU lacks instructions the model was compiled for");
        std::process::exit(3);
    }
    let model = digits::model().expect("descriptor");
    println!("model `{}`: input {:?}, arena {} bytes", model.name(), digits::INPUT_0_SHAPE, model.arena_bytes());
    let mut arena = Box::new(digits::Arena::new());
    for label in [0, 3, 7] {
        let image = load(label);
        let mut logits = [0f32; digits::OUTPUT_0_ELEMS];
        digits::run(&image, &mut logits, &mut arena).expect("run");
        let best = (0..logits.len()).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).unwrap();
        println!("image of a {label} -> predicted digit: {best}");
    }
}
