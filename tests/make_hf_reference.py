"""Writes tiny randomly initialised Llama, OPT and Gemma 3 checkpoints with reference
logits computed by Hugging Face Transformers, for hf_reference_test.

Not run by the tests (they read the committed output in tests/testdata/).
Re-run after changing it, in an environment with torch and transformers:

    python3 tests/make_hf_reference.py tests/testdata

Each model gets DIR/<name>/{config.json, model.safetensors, tokens.json,
logits.bin}: logits.bin holds float32 logits [len(tokens), vocab] of one
forward pass over tokens.json, row-major, little-endian.
"""
import json
import os
import sys

import torch
import transformers


def randomize(model, seed):
    # Default init (std 0.02, unit norms, zero biases) would leave biases and
    # norm gains untested; draw everything at a scale that matters.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 +
                    (1.0 if "norm" in name and name.endswith("weight") else 0.0))


def save(model, tokens, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    with open(os.path.join(out_dir, "tokens.json"), "w") as f:
        json.dump(tokens, f)
    logits.numpy().astype("<f4").tofile(os.path.join(out_dir, "logits.bin"))
    print(out_dir, tuple(logits.shape))


def main():
    out = sys.argv[1]
    torch.manual_seed(0)
    tokens = [1, 7, 30, 2, 19, 11, 5, 23, 23, 8, 0, 31, 14]
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=32,
        max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)).eval()
    randomize(llama, 1)
    save(llama, tokens, os.path.join(out, "hf_tiny_llama"))
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(
        hidden_size=16, ffn_dim=32, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=32, max_position_embeddings=64,
        word_embed_proj_dim=16, do_layer_norm_before=True,
        activation_function="relu", bos_token_id=2, eos_token_id=2,
        pad_token_id=1)).eval()
    randomize(opt, 2)
    save(opt, tokens, os.path.join(out, "hf_tiny_opt"))
    # Gemma 3: every second layer global, a window of 4 that the 13 tokens
    # overrun, head_dim not hidden / heads, two RoPE bases.
    gemma = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        hidden_size=16, intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        vocab_size=32, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_local_base_freq=10000.0,
        sliding_window=4, query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
        attn_logit_softcapping=None, rope_scaling=None,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
        attn_implementation="eager")).eval()
    # Gemma's norms scale by (1 + w): centre their draws on 0, not 1.
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in gemma.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    save(gemma, tokens, os.path.join(out, "hf_tiny_gemma3"))


if __name__ == "__main__":
    main()
