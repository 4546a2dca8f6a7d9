#!/usr/bin/env python3
"""Trains the bundled example model: a small CNN classifying the 8x8 handwritten digits
that ship with scikit-learn (1797 images), and exports it to examples/digits/model.onnx
with three held-out test images (digit_<label>.npy).

    pip install torch scikit-learn && python3 examples/digits/train.py
"""
import os

import numpy as np
import torch
import torch.nn as nn
from sklearn.datasets import load_digits

HERE = os.path.dirname(os.path.abspath(__file__))


class DigitNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 2 * 2, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.head(self.features(x))


def main():
    torch.manual_seed(0)
    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x))
    train, test = perm[:1500], perm[1500:]
    model = DigitNet()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(30):
        model.train()
        for i in range(0, len(train), 64):
            idx = train[i:i + 64]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model(x[test]).argmax(1) == y[test]).float().mean().item()
    print(f"held-out accuracy: {acc:.3f} on {len(test)} images")
    torch.onnx.export(model, (x[:1],), os.path.join(HERE, "model.onnx"), input_names=["image"],
                      output_names=["logits"], opset_version=17, dynamo=False)
    seen = set()
    for i in test.tolist():
        label = int(y[i])
        if label in (0, 3, 7) and label not in seen:
            seen.add(label)
            np.save(os.path.join(HERE, f"digit_{label}.npy"), x[i:i + 1].numpy())


if __name__ == "__main__":
    main()
