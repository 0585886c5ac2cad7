"""Writes a randomly initialised Llama (Hugging Face safetensors, fp16) for
GPU decode timings where no real model of that size can be carried:

    python3 bench/make_random_llama.py OUT_DIR [--layers=8] [--hidden=2048]

Default shape: hidden 2048, FFN 5632, 8 layers, 32 query heads over 8 KV
heads (head_dim 64), vocabulary 32000, context 32768: TinyLlama's layer
shape with fewer layers. Its weights are random, so only its timings and
byte counts mean anything (not its text or its perplexity). Needs torch and
transformers (the device machine has both); builds on the GPU when one
answers.
"""
import argparse
import sys

import benchutil


def main():
    ap = benchutil.parser(__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv_heads", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=32768)
    args = ap.parse_args()
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"make_random_llama.py: needs torch and transformers: {e}",
              file=sys.stderr)
        return 2
    cfg = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, vocab_size=32000,
        max_position_embeddings=args.ctx, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).half()
    model.save_pretrained(args.out_dir, safe_serialization=True)
    print(args.out_dir)


if __name__ == "__main__":
    sys.exit(main())
