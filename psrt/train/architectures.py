"""The shipped profiles' source: real architectures' parameter shapes and per-layer FLOP counts.

    python -m psrt.train.architectures      # writes psrt/train/profiles/*.json again

Shapes are those of the published models (sources in SOURCES); a layer's forward time is its
forward FLOPs per sample x the batch / RATE, its backward twice that (the backward computes
the gradients of the inputs and of the weights, each as many multiply-adds as the forward:
Kaplan et al., "Scaling Laws for Neural Language Models", 2020, sec. 2.1, 6N FLOPs per token
in training against 2N in the forward).  A multiply-add counts as 2 FLOPs.  Normalisation,
activations and pooling are left out of the FLOPs (memory-bound, a few per cent).

RATE is a stated sustained throughput, not a measurement: 100 TFLOP/s, about a third of an
A100's 312 TFLOP/s dense bf16 peak (NVIDIA A100 datasheet), below the 163 TFLOP/s per GPU
(52% of peak) Megatron-LM sustained on GPT-3-like models (Narayanan et al., SC 2021), since
CNNs at these batches reach less of the peak.  A profile recorded on one's own device
(psrt/train/recording.py) replaces it with measured times.
"""
from __future__ import annotations

import os

from psrt.train.profile import HERE, Layer, Profile

RATE = 100e12
DEVICE = "an accelerator sustaining 100 TFLOP/s (stated, see psrt/train/architectures.py)"
SOURCES = {
    "vgg16": "VGG-16 (configuration D): Simonyan and Zisserman, 'Very Deep Convolutional Networks for "
             "Large-Scale Image Recognition', ICLR 2015, Table 1; 224x224 inputs, 138.4 M parameters",
    "resnet50": "ResNet-50: He et al., 'Deep Residual Learning for Image Recognition', CVPR 2016, Table 1 "
                "(stride on the 3x3 convolution, as torchvision's v1.5); 224x224 inputs, 25.6 M parameters",
    "gpt2-small": "GPT-2 small: Radford et al., 'Language Models are Unsupervised Multitask Learners', 2019 "
                  "(12 layers, d=768, 1024 positions, 50257 tokens, output tied to the embedding); "
                  "attention FLOPs 2 x n_ctx x d per token and layer (Kaplan et al. 2020, Table 1); 124.4 M parameters",
    "bert-base": "BERT-base: Devlin et al., 'BERT: Pre-training of Deep Bidirectional Transformers', NAACL 2019 "
                 "(12 layers, d=768, FFN 3072, 30522 tokens, sequences of 128 as in 90% of its pre-training "
                 "steps, Appendix A.2), with the pooler; 109.5 M parameters",
}
BATCH = {"vgg16": 64, "resnet50": 64, "gpt2-small": 8, "bert-base": 32}


def conv(name: str, cin: int, cout: int, k: int, hw_out: int, bias: bool = True, bn: bool = False):
    """A k x k convolution (and its batch norm's scale and shift): (name, params, forward FLOPs
    per sample)."""
    params = [("weight", (cout, cin, k, k))] + ([("bias", (cout,))] if bias else [])
    if bn:
        params += [("bn.weight", (cout,)), ("bn.bias", (cout,))]
    return name, params, 2 * k * k * cin * cout * hw_out * hw_out


def linear(name: str, fin: int, fout: int, tokens: int = 1, extra: list | None = None):
    """A fully connected layer (weight stored out x in, as torch's), over `tokens` positions."""
    return name, [("weight", (fout, fin)), ("bias", (fout,))] + (extra or []), 2 * fin * fout * tokens


def vgg16() -> list:
    layers, cin, side = [], 3, 224
    for i, width in enumerate([64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]):
        if width == "M":
            side //= 2
            continue
        layers.append(conv(f"features.{i}", cin, width, 3, side))
        cin = width
    layers += [linear("classifier.0", 512 * 7 * 7, 4096), linear("classifier.3", 4096, 4096),
               linear("classifier.6", 4096, 1000)]
    return layers


def resnet50() -> list:
    layers = [conv("conv1", 3, 64, 7, 112, bias=False, bn=True)]
    cin, side = 64, 56
    for stage, (blocks, width) in enumerate(zip([3, 4, 6, 3], [64, 128, 256, 512]), 1):
        for b in range(blocks):
            stride = 2 if b == 0 and stage > 1 else 1
            out_side = side // stride
            p = f"layer{stage}.{b}"
            layers.append(conv(f"{p}.conv1", cin, width, 1, side, bias=False, bn=True))
            layers.append(conv(f"{p}.conv2", width, width, 3, out_side, bias=False, bn=True))
            layers.append(conv(f"{p}.conv3", width, 4 * width, 1, out_side, bias=False, bn=True))
            if b == 0:
                layers.append(conv(f"{p}.downsample", cin, 4 * width, 1, out_side, bias=False, bn=True))
            cin, side = 4 * width, out_side
    layers.append(linear("fc", 2048, 1000))
    return layers


def _norm(name: str, d: int):
    return name, [("weight", (d,)), ("bias", (d,))], 0


def gpt2_small(d: int = 768, n_layer: int = 12, ctx: int = 1024, vocab: int = 50257) -> list:
    layers = [("wte", [("weight", (vocab, d))], 0), ("wpe", [("weight", (ctx, d))], 0)]
    for i in range(n_layer):
        p = f"h.{i}"
        layers += [_norm(f"{p}.ln_1", d), linear(f"{p}.attn.c_attn", d, 3 * d, ctx)]
        name, params, flops = linear(f"{p}.attn.c_proj", d, d, ctx)
        layers.append((name, params, flops + 2 * ctx * d * ctx))     # QK^T and AV over the context
        layers += [_norm(f"{p}.ln_2", d), linear(f"{p}.mlp.c_fc", d, 4 * d, ctx),
                   linear(f"{p}.mlp.c_proj", 4 * d, d, ctx)]
    name, params, _ = _norm("ln_f", d)
    layers.append((name, params, 2 * d * vocab * ctx))                # the tied output projection
    return layers


def bert_base(d: int = 768, n_layer: int = 12, seq: int = 128, vocab: int = 30522) -> list:
    layers = [("embeddings", [("word", (vocab, d)), ("position", (512, d)), ("token_type", (2, d)),
                              ("norm.weight", (d,)), ("norm.bias", (d,))], 0)]
    for i in range(n_layer):
        p = f"layer.{i}"
        name, params, flops = linear(f"{p}.attention.qkv", d, 3 * d, seq)
        layers.append((name, params, flops + 2 * seq * d * seq * 2))   # bidirectional: the full T x T
        layers += [linear(f"{p}.attention.output", d, d, seq, [("norm.weight", (d,)), ("norm.bias", (d,))]),
                   linear(f"{p}.intermediate", d, 4 * d, seq),
                   linear(f"{p}.output", 4 * d, d, seq, [("norm.weight", (d,)), ("norm.bias", (d,))])]
    layers.append(linear("pooler", d, d))
    return layers


ARCHITECTURES = {"vgg16": vgg16, "resnet50": resnet50, "gpt2-small": gpt2_small, "bert-base": bert_base}


def profile(name: str, rate: float = RATE) -> Profile:
    """The profile of architecture `name` at its batch (BATCH) on an accelerator of `rate` FLOP/s."""
    batch = BATCH[name]
    layers = tuple(Layer(n, tuple(params), flops * batch / rate, 2 * flops * batch / rate)
                   for n, params, flops in ARCHITECTURES[name]())
    fwd = sum(f for _, _, f in ARCHITECTURES[name]())
    return Profile(name, batch, layers, SOURCES[name], DEVICE,
                   notes={"forward_gflop_per_sample": round(fwd / 1e9, 3), "flop_rate": rate})


def main() -> None:
    os.makedirs(HERE, exist_ok=True)
    for name in ARCHITECTURES:
        p = profile(name)
        p.save(os.path.join(HERE, name + ".json"))
        print(p.describe())


if __name__ == "__main__":
    main()
