#!/usr/bin/env python3
"""Hugging Face Transformers at a model's shape with random weights: prefill
and decode tokens/s with its DynamicCache (all KV on the GPU) or its
offloaded cache (KV in host memory, moved back layer by layer), the
baseline bench-decode's GPU figures are compared with.

    python3 bench/hf_baseline.py --model_config=llama-2-7b --ctx=4096 \\
        --batch=1 --cache=dynamic

--model_config takes the names infinigen's --load_format=dummy takes
(llama-2-7b, llama-3-8b; the same Hugging Face configurations) or a
config.json path. Needs torch and transformers (the GPU host has both; no
download: the weights are random). Prints one JSON line on stdout:
{"system": "hf-transformers", "policy": CACHE, "model", "ctx", "batch",
"decode_tokens", "prefill_tokens_per_s", "decode_tokens_per_s", "device",
"torch", "transformers"}, or the same keys with "error" (out of memory, an
unknown cache) and exit status 1. Timing: generate() of 1 new token
(prefill) and of 1 + --decode_tokens new tokens, greedy, after a warm-up;
decode tokens/s = batch x decode_tokens / the difference.
"""
import argparse
import json
import sys
import time

# The configurations of model/dummy.cc's presets (Hugging Face's config.json
# of each model, the Llama ones with max_position_embeddings raised to
# 131072); tests/hf_baseline_test.py checks that they agree.
PRESETS = {
    "llama-2-7b": {
        "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32,
        "vocab_size": 32000, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu",
        "tie_word_embeddings": False},
    "llama-3-8b": {
        "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "bos_token_id": 128000, "eos_token_id": 128001,
        "hidden_act": "silu", "tie_word_embeddings": False},
}
CACHES = ("dynamic", "offloaded")


def load_config(name):
    if name in PRESETS:
        return dict(PRESETS[name])
    path = name if name.endswith(".json") else name.rstrip("/") + "/config.json"
    with open(path) as f:
        return json.load(f)


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model_config", required=True,
                    help="llama-2-7b, llama-3-8b or a config.json path")
    ap.add_argument("--ctx", type=int, required=True,
                    help="prompt tokens per sequence")
    ap.add_argument("--batch", type=int, default=1, help="sequences")
    ap.add_argument("--decode_tokens", type=int, default=32,
                    help="decode steps timed")
    ap.add_argument("--cache", choices=CACHES, default="dynamic",
                    help="dynamic: KV on the device; offloaded: in host "
                         "memory (cache_implementation='offloaded')")
    ap.add_argument("--device", default="cuda", help="cuda or cpu")
    ap.add_argument("--dtype", default="float16",
                    choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.ctx < 1 or args.batch < 1 or args.decode_tokens < 1:
        ap.error("--ctx, --batch and --decode_tokens must be >= 1")
    try:
        load_config(args.model_config)
    except (OSError, ValueError) as e:
        ap.error(f"--model_config: {args.model_config}: {e} (known: "
                 f"{', '.join(PRESETS)})")
    return args


def run(args):
    import torch
    import transformers

    report = {"system": "hf-transformers", "policy": args.cache,
              "model": args.model_config, "ctx": args.ctx,
              "batch": args.batch, "decode_tokens": args.decode_tokens,
              "torch": torch.__version__,
              "transformers": transformers.__version__}
    device = torch.device(args.device)
    report["device"] = (torch.cuda.get_device_name(device)
                        if device.type == "cuda" else "cpu")
    cfg = load_config(args.model_config)
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"],
                                         args.ctx + args.decode_tokens + 2)
    config = transformers.LlamaConfig(**{k: v for k, v in cfg.items()
                                         if k != "model_type"})
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    torch.set_default_dtype(dtype)
    with device:
        model = transformers.LlamaForCausalLM(config)
    model.eval()
    ids = torch.randint(3, config.vocab_size, (args.batch, args.ctx),
                        device=device)

    def generate(tokens, new):
        kwargs = dict(max_new_tokens=new, min_new_tokens=new,
                      do_sample=False, pad_token_id=0, eos_token_id=None,
                      attention_mask=torch.ones_like(tokens))
        if args.cache == "offloaded":
            kwargs["cache_implementation"] = "offloaded"
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(tokens, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        assert out.shape[1] == tokens.shape[1] + new, out.shape
        return time.perf_counter() - start

    try:
        generate(ids[:, : min(args.ctx, 16)], 2)  # warm-up
        prefill = generate(ids, 1)
        whole = generate(ids, 1 + args.decode_tokens)
    except torch.cuda.OutOfMemoryError as e:
        report["error"] = f"out of memory: {str(e).splitlines()[0]}"
        return report
    except (RuntimeError, ValueError, TypeError) as e:
        # A cache this Transformers cannot run here (the offloaded cache
        # wants a GPU), or a version that takes other arguments.
        lines = str(e).strip().splitlines() or [""]
        report["error"] = f"{type(e).__name__}: {lines[0]}"
        return report
    report["prefill_tokens_per_s"] = args.batch * args.ctx / prefill
    report["decode_tokens_per_s"] = (args.batch * args.decode_tokens /
                                     max(whole - prefill, 1e-9))
    return report


class NoDevice(Exception):
    """--device names a CUDA device torch cannot use, or a run needs one."""


def main(argv):
    args = parse_args(argv)
    try:
        import torch
        if args.cache == "offloaded" and not args.device.startswith("cuda"):
            raise NoDevice("the offloaded cache moves KV between a CUDA "
                           "device and the host: it needs --device=cuda")
        if args.device.startswith("cuda"):
            # is_available() can say yes where the driver then refuses
            # (older than the runtime): one allocation tells.
            try:
                torch.zeros(1, device=args.device)
            except Exception as e:  # torch's errors differ by version
                raise NoDevice(f"{e} (--device=cpu runs on the CPU)") from e
        report = run(args)
    except ImportError as e:
        print(f"hf_baseline.py: needs torch and transformers: {e}",
              file=sys.stderr)
        return 2
    except NoDevice as e:
        print(f"hf_baseline.py: no CUDA device: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
