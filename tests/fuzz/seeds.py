#!/usr/bin/env python3
"""Write the fuzz targets' seed inputs (tests/fuzz/corpus/<target>/seed_*).

The seeds are valid inputs of each parser (the released and flattened
config spellings, small safetensors files of every dtype the reader knows,
a shard index) and byte programs for the targets that read their input as
choices (fuzz_engine, fuzz_api, fuzz_cp); libFuzzer mutates from them, and ctest replays them with
whatever inputs a fuzzing run found worth keeping (scripts/fuzz). Inputs
that depend on the library's own synthesized checkpoint (fuzz_model's
headers) are written by the target itself (M3_FUZZ_WRITE_SEED), before
this script derives their poisoned copies. Run from
anywhere; standard library only; deterministic.
"""
import json
import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))

FLAGS60 = [0, 0, 0] + [1] * 57
TEXT = {
    "model_type": "minimax_m3", "hidden_size": 6144, "num_hidden_layers": 60,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
    "rotary_dim": 64, "partial_rotary_factor": 0.5, "rope_theta": 5000000,
    "vocab_size": 200064, "intermediate_size": 3072, "dense_intermediate_size": 12288,
    "shared_intermediate_size": 3072, "n_shared_experts": 1, "num_local_experts": 128,
    "num_experts_per_tok": 4, "moe_layer_freq": FLAGS60, "scoring_func": "sigmoid",
    "use_routing_bias": True, "routed_scaling_factor": 2.0, "hidden_act": "swigluoai",
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "rms_norm_eps": 1e-06,
    "use_gemma_norm": True, "qk_norm_type": "per_head", "tie_word_embeddings": False,
    "max_position_embeddings": 1048576, "eos_token_id": 200020,
    "sparse_attention_config": {
        "use_sparse_attention": True, "sparse_attention_freq": FLAGS60,
        "sparse_num_index_heads": 4, "sparse_index_dim": 128, "sparse_block_size": 128,
        "sparse_topk_blocks": 16, "sparse_init_block": 0, "sparse_local_block": 1,
        "sparse_score_type": "max", "sparse_disable_index_value": FLAGS60},
}
HF = {
    "model_type": "minimax_m3", "architectures": ["MiniMaxM3SparseForCausalLM"],
    "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5},
    "vocab_size": 512, "intermediate_size": 64, "dense_intermediate_size": 256,
    "shared_intermediate_size": 64, "n_shared_experts": 1, "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "layer_types": ["full_attention"] + ["minimax_m3_sparse"] * 3,
    "mlp_layer_types": ["dense"] + ["sparse"] * 3,
    "index_n_heads": 2, "index_head_dim": 64, "index_block_size": 128,
    "index_topk_blocks": 4, "index_local_blocks": 1, "scoring_func": "sigmoid",
    "use_routing_bias": True, "routed_scaling_factor": 2.0, "hidden_act": "silu",
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "rms_norm_eps": 1e-06,
    "use_gemma_norm": True, "qk_norm_type": "per_head", "tie_word_embeddings": True,
    "max_position_embeddings": 4096, "eos_token_id": [1, 2],
    "quantization_config": {"quant_method": "mxfp8", "weight_block_size": [1, 32]},
}


def st_file(tensors, meta=None, pad_to=8):
    """A safetensors file: tensors = [(name, dtype, shape, bytes)]."""
    header, data = {}, b""
    if meta is not None:
        header["__metadata__"] = meta
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % pad_to)
    return struct.pack("<Q", len(text)) + text + data


def put(target, name, blob):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed_" + name), "wb") as f:
        f.write(blob if isinstance(blob, bytes) else blob.encode())


def main():
    nested = {"architectures": ["MiniMaxM3SparseForConditionalGeneration"],
              "model_type": "minimax_m3_vl",
              "vision_config": {"hidden_size": 1280, "model_type": "minimax_vit"},
              "text_config": TEXT}
    put("fuzz_config", "released.json", json.dumps(nested, indent=1))
    put("fuzz_config", "flat.json", json.dumps(TEXT))
    put("fuzz_config", "hf_flattened.json", json.dumps(HF))
    # DSpark drafters (docs/DSPARK.md): the release's nested spelling with a
    # key window, and NeMo's flat one
    draft = {"hidden_size": 6144, "num_hidden_layers": 5, "num_attention_heads": 64,
             "num_key_value_heads": 4, "head_dim": 128, "rotary_dim": 64,
             "rope_theta": 5000000, "vocab_size": 200064, "rms_norm_eps": 1e-06,
             "use_gemma_norm": True, "hidden_act": "swigluoai",
             "dspark_target_layer_ids": [3, 17, 31, 45, 59], "dspark_noise_token_id": 200058,
             "dspark_block_size": 7, "dspark_markov_rank": 256,
             "dspark_markov_head_type": "vanilla", "dspark_ffn_hidden_size": 12288,
             "layer_types": ["sliding_attention"] * 5, "sliding_window": 4096}
    put("fuzz_config", "dspark_release.json", json.dumps(
        {"text_config": draft,
         "quantization_config": {"quant_method": "mxfp8", "weight_block_size": [1, 32]}}))
    nemo = {k: v for k, v in draft.items() if not k.startswith("dspark_")
            and k not in ("layer_types", "sliding_window")}
    nemo.update({"target_layer_ids": [10, 22, 34, 46, 58], "mask_token_id": 128799,
                 "block_size": 7, "markov_rank": 256, "markov_head_type": "vanilla",
                 "num_anchors": 512, "enable_confidence_head": False})
    put("fuzz_config", "dspark_nemo.json", json.dumps(nemo))

    bf16 = struct.pack("<8H", *range(0x3f80, 0x3f88))
    f32 = struct.pack("<4f", 1.0, -2.0, 0.5, 3.0)
    put("fuzz_safetensors", "bf16_f32.safetensors",
        st_file([("a.weight", "BF16", [2, 4], bf16), ("b.bias", "F32", [4], f32)],
                meta={"format": "pt"}))
    put("fuzz_safetensors", "mxfp8.safetensors",
        st_file([("w.weight", "F8_E4M3", [2, 32], bytes(range(64))),
                 ("w.weight_scale_inv", "U8", [2, 1], b"\x7f\x80")]))
    put("fuzz_safetensors", "odd.safetensors",
        st_file([("u", "U8", [3], b"\x01\x02\x03"), ("empty", "BF16", [0, 4], b""),
                 ("x", "F32", [], struct.pack("<f", 7.0)),
                 ("i", "I64", [1], struct.pack("<q", -1))], pad_to=1))

    index = {"metadata": {"total_size": 28},
             "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                            "b.bias": "model-00002-of-00002.safetensors"}}
    put("fuzz_st_index", "two_shards.json", json.dumps(index))

    # byte programs (fuzz_engine: a config's choices; fuzz_api: calls)
    put("fuzz_engine", "zero", bytes(40))
    put("fuzz_engine", "a", bytes([1] * 13 + [0] * 5 + [1, 1, 1, 0, 0, 0xff, 0xfe, 1, 5, 0, 1, 0]))
    rng = random.Random(1)
    for k in range(4):
        put("fuzz_api", str(k), bytes([k, 0, 0, 0, 1, 0, 2] +
                                      [rng.randrange(256) for _ in range(200)]))
    # fuzz_model: a poisoned copy of each seed the target wrote (its
    # variant byte, 7 poisonings of 4 bytes, then the header)
    rng = random.Random(5)
    for v in ("bf16", "mxfp8"):
        path = os.path.join(HERE, "corpus", "fuzz_model", "seed_%s.json" % v)
        if os.path.exists(path):
            with open(path, "rb") as f:
                b = f.read()
            poison = bytes([rng.randrange(256) for _ in range(28)])
            put("fuzz_model", v + "_poisoned.json", b[:1] + bytes([7]) + poison + b[2:])
    rng = random.Random(3)  # fuzz_cp: shapes, lengths, tables, then values
    for k in range(4):
        put("fuzz_cp", str(k), bytes([rng.randrange(256) for _ in range(600)]))


if __name__ == "__main__":
    main()
