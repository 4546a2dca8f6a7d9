#!/usr/bin/env python3
"""Builds the benchmark zoo of issue 5: make_zoo.py OUT_DIR

Writes OUT_DIR/NAME.onnx for each model below: torchvision architectures and small
hand-written ones, random weights (seeded), eval mode, batch 1, static shapes, opset 17,
exported with torch.onnx.export (TorchScript exporter). Needs torch and torchvision:

    pip install torch torchvision && python3 tests/bench/make_zoo.py target/zoo

The models are not committed (ResNet-18 alone is 45 MB); tests/bench/zoo.sh builds them
when missing and benchmarks each one against ONNX Runtime.
"""
import os
import sys

import torch
import torch.nn as nn
import torchvision

# The fixtures' BERT layer (post-LN, GELU FFN), shared rather than copied.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures"))
from make_fixtures import BertLayer  # noqa: E402


class Bert(nn.Module):
    """A MiniLM-class encoder: 6 layers, hidden 384, 12 heads, FFN 1536."""

    def __init__(self, vocab=30522, hidden=384, heads=12, inter=1536, layers=6, max_pos=512):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_pos, hidden)
        self.typ = nn.Embedding(2, hidden)
        self.ln = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList([BertLayer(hidden, heads, inter) for _ in range(layers)])

    def forward(self, input_ids, attention_mask):
        s = input_ids.shape[1]
        pos = torch.arange(s, device=input_ids.device).unsqueeze(0)
        x = self.ln(self.word(input_ids) + self.pos(pos) + self.typ(torch.zeros_like(input_ids)))
        mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        for layer in self.layers:
            x = layer(x, mask)
        return x


def small_cnn():
    """A digit-classifier-sized CNN on 1x28x28."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def mlp():
    return nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def vit_tiny():
    from torchvision.models.vision_transformer import VisionTransformer

    m = VisionTransformer(image_size=224, patch_size=16, num_layers=12, num_heads=3,
                          hidden_dim=192, mlp_dim=768, num_classes=1000)
    # torchvision zero-initialises the classifier head: the output would be all zeros and
    # the benchmark's comparison with ONNX Runtime would check nothing.
    nn.init.normal_(m.heads.head.weight, std=0.02)
    nn.init.normal_(m.heads.head.bias, std=0.02)
    return m


def zoo():
    image = torch.randn(1, 3, 224, 224)
    ids = torch.randint(0, 30522, (1, 128))
    mask = torch.ones(1, 128, dtype=torch.int64)
    return [
        ("resnet18", torchvision.models.resnet18(), (image,), ["image"]),
        ("mobilenet_v2", torchvision.models.mobilenet_v2(), (image,), ["image"]),
        ("squeezenet1_1", torchvision.models.squeezenet1_1(), (image,), ["image"]),
        ("efficientnet_b0", torchvision.models.efficientnet_b0(), (image,), ["image"]),
        ("vit_tiny", vit_tiny(), (image,), ["image"]),
        ("bert6_seq128", Bert(), (ids, mask), ["input_ids", "attention_mask"]),
        ("mlp", mlp(), (torch.randn(1, 784),), ["x"]),
        ("small_cnn", small_cnn(), (torch.randn(1, 1, 28, 28),), ["image"]),
    ]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "target/zoo"
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    for name, model, inputs, input_names in zoo():
        path = os.path.join(out, f"{name}.onnx")
        if os.path.exists(path):
            print(f"{name}: exists")
            continue
        model.eval()
        with torch.no_grad():
            torch.onnx.export(model, inputs, path, input_names=input_names,
                              output_names=["output"], opset_version=17, dynamo=False)
        print(f"{name}: {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
