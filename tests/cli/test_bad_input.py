#!/usr/bin/env python3
"""Bad-input tests for the `m3` command-line program: checkpoints.

Every case feeds `m3` one broken config.json, safetensors file or
checkpoint folder and checks that the program refuses it the way the CLI
promises (bad_input_harness.py says how; test_bad_args.py holds the
command-line argument cases): the expected failure code, stderr naming the
field, tensor or value, the "m3 <cmd>: M3_ERR_<...>: <message>" report, no
sanitizer or crash report (the test also runs against the AddressSanitizer
+ UBSan build), no hang. Two positive controls make sure the harness can
tell success from failure.

Usage: test_bad_input.py --m3 PATH_TO_M3 --work SCRATCH_DIR [-k SUBSTRING] [-v]
Python 3 standard library only (numpy is not needed).
"""
import json
import os
import shutil
import struct
import sys

import bad_input_harness as H
from bad_input_harness import *  # noqa: F401,F403 (case, Failure, the checkpoint helpers)


# ------------------------------------------------------------------ config.json

@case
def config_missing_file():
    d = copy_good("config_missing_file")
    os.remove(os.path.join(d, "config.json"))
    expect_gen_fail(d, ["M3_ERR_IO", "config.json"])


@case
def config_not_json():
    d = with_config("config_not_json", text='{"text_config": {"hidden_size": 256,, }')
    expect_gen_fail(d, ["config.json", "not valid JSON"])


@case
def config_empty_file():
    d = with_config("config_empty_file", text="")
    expect_gen_fail(d, ["config.json", "not valid JSON"])


@case
def config_binary_garbage():
    d = with_config("config_binary_garbage", text=bytes(range(256)) * 4)
    expect_gen_fail(d, ["config.json", "not valid JSON"])


@case
def config_deeply_nested():
    # must be refused, not recurse until the stack runs out
    d = with_config("config_deeply_nested", text="[" * 200000 + "]" * 200000)
    expect_gen_fail(d, ["config.json"])


@case
def config_top_level_list():
    d = with_config("config_top_level_list", text=json.dumps([load_config()]))
    expect_gen_fail(d, ["config.json", "top level must be an object"])


@case
def config_text_config_not_object():
    d = with_config("config_text_config_not_object",
                    mutate=lambda c: c.__setitem__("text_config", [1, 2]))
    expect_gen_fail(d, ["'text_config' must be an object"])




@case
def config_missing_hidden_size():
    d = with_config("config_missing_hidden_size", _del_text("hidden_size"))
    expect_gen_fail(d, ["missing required field 'hidden_size'", "M3_ERR_CONFIG"])


@case
def config_missing_vocab_size():
    d = with_config("config_missing_vocab_size", _del_text("vocab_size"))
    expect_gen_fail(d, ["missing required field 'vocab_size'"])


@case
def config_missing_num_attention_heads():
    d = with_config("config_missing_num_attention_heads", _del_text("num_attention_heads"))
    expect_gen_fail(d, ["missing required field 'num_attention_heads'"])


@case
def config_missing_num_hidden_layers():
    d = with_config("config_missing_num_hidden_layers", _del_text("num_hidden_layers"))
    expect_gen_fail(d, ["missing required field 'num_hidden_layers'"])


@case
def config_missing_num_local_experts():
    d = with_config("config_missing_num_local_experts", _del_text("num_local_experts"))
    expect_gen_fail(d, ["missing required field 'num_local_experts'"])


@case
def config_missing_sparse_topk_blocks():
    d = with_config("config_missing_sparse_topk_blocks", _del_sparse("sparse_topk_blocks"))
    expect_gen_fail(d, ["missing required field 'sparse_topk_blocks'"])


@case
def config_wrong_type_hidden_size_string():
    d = with_config("config_wrong_type_hidden_size_string", _set_text("hidden_size", "256"))
    expect_gen_fail(d, ["'hidden_size' must be an integer"])


@case
def config_wrong_type_hidden_size_fraction():
    d = with_config("config_wrong_type_hidden_size_fraction", _set_text("hidden_size", 256.5))
    expect_gen_fail(d, ["'hidden_size' must be an integer"])


@case
def config_wrong_type_bool_field():
    d = with_config("config_wrong_type_bool_field", _set_text("use_routing_bias", "yes"))
    expect_gen_fail(d, ["'use_routing_bias' must be true or false"])


@case
def config_wrong_type_moe_layer_freq():
    d = with_config("config_wrong_type_moe_layer_freq", _set_text("moe_layer_freq", "0,1,1"))
    expect_gen_fail(d, ["'moe_layer_freq' must be a list"])


@case
def config_wrong_type_sparse_config():
    d = with_config("config_wrong_type_sparse_config",
                    _set_text("sparse_attention_config", 128))
    expect_gen_fail(d, ["'sparse_attention_config' must be an object"])


@case
def config_out_of_range_heads_zero():
    d = with_config("config_out_of_range_heads_zero", _set_text("num_attention_heads", 0))
    expect_gen_fail(d, ["num_attention_heads = 0 is out of range"])


@case
def config_out_of_range_hidden_size_huge():
    d = with_config("config_out_of_range_hidden_size_huge", _set_text("hidden_size", 10 ** 12))
    expect_gen_fail(d, ["hidden_size = 1000000000000 is out of range"])


@case
def config_out_of_range_vocab_negative():
    d = with_config("config_out_of_range_vocab_negative", _set_text("vocab_size", -5))
    expect_gen_fail(d, ["vocab_size = -5 is out of range"])


@case
def config_out_of_range_layers():
    d = with_config("config_out_of_range_layers", _set_text("num_hidden_layers", 100000))
    expect_gen_fail(d, ["num_hidden_layers = 100000 is out of range"])


@case
def config_out_of_range_number_beyond_double():
    # 1e400 is not a finite double; JSON parsers may turn it into inf
    d = with_config("config_out_of_range_number_beyond_double",
                    text=json.dumps(load_config()).replace('"hidden_size": 256',
                                                           '"hidden_size": 1e400'))
    expect_gen_fail(d, ["hidden_size"])


@case
def config_out_of_range_max_position_zero():
    d = with_config("config_out_of_range_max_position_zero",
                    _set_text("max_position_embeddings", 0))
    expect_gen_fail(d, ["max_position_embeddings = 0 is out of range"])


@case
def config_sparse_block_size_64():
    d = with_config("config_sparse_block_size_64", _set_sparse("sparse_block_size", 64))
    expect_gen_fail(d, ["sparse_block_size = 64 is not supported", "M3_ERR_UNSUPPORTED"])


@case
def config_moe_layer_freq_wrong_length():
    d = with_config("config_moe_layer_freq_wrong_length", _set_text("moe_layer_freq", [0, 1]))
    expect_gen_fail(d, ["'moe_layer_freq' has 2 entries for 3 layers"])


@case
def config_moe_layer_freq_bad_entry():
    d = with_config("config_moe_layer_freq_bad_entry", _set_text("moe_layer_freq", [0, 2, 1]))
    expect_gen_fail(d, ["moe_layer_freq[1] must be 0 or 1"])


@case
def config_sparse_freq_wrong_length():
    d = with_config("config_sparse_freq_wrong_length",
                    _set_sparse("sparse_attention_freq", [0, 1, 1, 1]))
    expect_gen_fail(d, ["'sparse_attention_freq' has 4 entries for 3 layers"])


@case
def config_heads_not_multiple_of_kv():
    d = with_config("config_heads_not_multiple_of_kv", _set_text("num_key_value_heads", 3))
    expect_gen_fail(d, ["num_attention_heads = 4 is not a multiple of num_key_value_heads = 3"])


@case
def config_experts_per_tok_exceeds_experts():
    d = with_config("config_experts_per_tok_exceeds_experts",
                    _set_text("num_experts_per_tok", 9))
    expect_gen_fail(d, ["num_experts_per_tok = 9 exceeds num_local_experts = 8"])


@case
def config_unsupported_activation():
    d = with_config("config_unsupported_activation", _set_text("hidden_act", "gelu"))
    expect_gen_fail(d, ["hidden_act = gelu is not supported"])


@case
def config_unsupported_model_type():
    d = with_config("config_unsupported_model_type", _set_text("model_type", "llama"))
    expect_gen_fail(d, ["model_type = llama is not MiniMax-M3"])


@case
def config_eos_outside_vocab():
    d = with_config("config_eos_outside_vocab", _set_text("eos_token_id", 512))
    expect_gen_fail(d, ["eos_token_id = 512 is outside the vocab 512"])


@case
def config_unsupported_quantization():
    d = with_config("config_unsupported_quantization",
                    lambda c: c.__setitem__("quantization_config", {"quant_method": "gptq"}))
    expect_gen_fail(d, ["quant_method = gptq is not supported"])


@case
def config_hidden_size_disagrees_with_checkpoint():
    # a valid config that does not describe these weights: the first bound
    # tensor's shape is named
    d = with_config("config_hidden_size_disagrees_with_checkpoint", _set_text("hidden_size", 128))
    expect_gen_fail(d, [PREFIX + "embed_tokens.weight has shape [512, 256]; expected [512, 128]"])


@case
def config_vocab_disagrees_with_checkpoint():
    d = with_config("config_vocab_disagrees_with_checkpoint", _set_text("vocab_size", 1024))
    expect_gen_fail(d, [PREFIX + "embed_tokens.weight has shape [512, 256]; expected [1024, 256]"])


@case
def config_experts_disagree_with_checkpoint():
    d = with_config("config_experts_disagree_with_checkpoint", _set_text("num_local_experts", 16))
    expect_gen_fail(d, [PREFIX + "layers.1.block_sparse_moe.gate.weight has shape [8, 256]; "
                        "expected [16, 256]"])


@case
def config_is_a_directory():
    d = copy_good("config_is_a_directory")
    os.remove(os.path.join(d, "config.json"))
    os.mkdir(os.path.join(d, "config.json"))
    expect_gen_fail(d, ["config.json"])


# ------------------------------------------------------------------ safetensors

@case
def st_truncated_in_data():
    raw = good_bytes()
    d = with_st_bytes("st_truncated_in_data", raw[:len(raw) - 1000])
    # the last tensor in the file now ends past the data section
    expect_gen_fail(d, ["language_model.lm_head.weight", "outside the data section"])


@case
def st_truncated_in_header():
    raw = good_bytes()
    d = with_st_bytes("st_truncated_in_header", raw[:8 + 100])
    expect_gen_fail(d, [ST_NAME, "runs past the end of the file"])


@case
def st_truncated_in_length_prefix():
    d = with_st_bytes("st_truncated_in_length_prefix", good_bytes()[:5])
    expect_gen_fail(d, [ST_NAME, "truncated (5 bytes"])


@case
def st_empty_file():
    d = with_st_bytes("st_empty_file", b"")
    expect_gen_fail(d, [ST_NAME, "truncated (0 bytes"])


@case
def st_header_length_past_eof():
    raw = good_bytes()
    d = with_st_bytes("st_header_length_past_eof", struct.pack("<Q", len(raw)) + raw[8:])
    expect_gen_fail(d, [f"header length {len(raw)} runs past the end of the file"])


@case
def st_header_length_huge():
    raw = good_bytes()
    d = with_st_bytes("st_header_length_huge", struct.pack("<Q", 2 ** 64 - 1) + raw[8:])
    expect_gen_fail(d, [f"header length {2 ** 64 - 1} is over the 100 MiB limit"])


@case
def st_header_length_zero():
    raw = good_bytes()
    d = with_st_bytes("st_header_length_zero", struct.pack("<Q", 0) + raw[8:])
    expect_gen_fail(d, [ST_NAME, "header is not valid JSON"])


@case
def st_header_not_json():
    st = good_st()
    h = st.header_bytes()
    bad = b"this is not json" + b" " * (len(h) - 16)
    d = with_st("st_header_not_json", lambda s: None, header=bad)
    expect_gen_fail(d, [ST_NAME, "header is not valid JSON"])


@case
def st_header_trailing_garbage():
    st = good_st()
    h = st.header_bytes().rstrip(b" ") + b"xx"
    d = with_st("st_header_trailing_garbage", lambda s: None, header=h)
    expect_gen_fail(d, [ST_NAME, "header is not valid JSON"])


@case
def st_header_json_list():
    d = with_st("st_header_json_list", lambda s: None, header=b"[1, 2, 3]" + b" " * 47)
    expect_gen_fail(d, [ST_NAME, "header is JSON but not an object"])


@case
def st_header_nul_byte():
    h = good_st().header_bytes()
    h = h[:-1] + b"\0"
    d = with_st("st_header_nul_byte", lambda s: None, header=h)
    expect_gen_fail(d, [ST_NAME, "NUL byte"])


@case
def st_header_empty_object():
    d = with_st("st_header_empty_object", lambda s: None, header=b"{}" + b" " * 54)
    expect_gen_fail(d, ["checkpoint has no embedding"])


@case
def st_header_metadata_only():
    # a well-formed file that holds no tensors
    d = with_st("st_header_metadata_only",
                lambda st: setattr(st, "items", [kv for kv in st.items if kv[0] == "__metadata__"]))
    expect_gen_fail(d, ["checkpoint has no embedding"])


@case
def st_overlapping_offsets():
    a, b = PREFIX + "layers.0.self_attn.q_norm.weight", PREFIX + "layers.0.self_attn.k_norm.weight"

    def m(st):
        st.get(b)["data_offsets"] = list(st.get(a)["data_offsets"])
    d = with_st("st_overlapping_offsets", m)
    expect_gen_fail(d, ["overlap", "q_norm.weight", "k_norm.weight"])


@case
def st_partially_overlapping_offsets():
    name = PREFIX + "layers.0.self_attn.k_norm.weight"

    def m(st):
        b, e = st.get(name)["data_offsets"]
        st.get(name)["data_offsets"] = [b - 2, e - 2]
    d = with_st("st_partially_overlapping_offsets", m)
    expect_gen_fail(d, ["overlap", "k_norm.weight"])


@case
def st_offsets_past_end():
    name = PREFIX + "norm.weight"
    n = len(good_st().data)

    def m(st):
        st.get(name)["data_offsets"] = [n, n + 512]
    d = with_st("st_offsets_past_end", m)
    expect_gen_fail(d, [name, f"data_offsets [{n}, {n + 512}] outside the data section"])


@case
def st_offsets_reversed():
    name = PREFIX + "norm.weight"

    def m(st):
        b, e = st.get(name)["data_offsets"]
        st.get(name)["data_offsets"] = [e, b]
    d = with_st("st_offsets_reversed", m)
    expect_gen_fail(d, [name, "data_offsets"])


@case
def st_offsets_not_integers():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["data_offsets"] = [0.5, "x"]
    d = with_st("st_offsets_not_integers", m)
    expect_gen_fail(d, [name, "is not [begin, end] of non-negative integers"])


@case
def st_offsets_beyond_2_53():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["data_offsets"] = [2 ** 64 - 512, 2 ** 64]
    d = with_st("st_offsets_beyond_2_53", m)
    expect_gen_fail(d, [name, "data_offsets"])


@case
def st_size_mismatch():
    name = PREFIX + "norm.weight"

    def m(st):
        b, e = st.get(name)["data_offsets"]
        st.get(name)["data_offsets"] = [b, e - 2]
    d = with_st("st_size_mismatch", m)
    expect_gen_fail(d, [name, "span 510 bytes but shape [256] of BF16 needs 512"])


@case
def st_shape_negative():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["shape"] = [-256]
    d = with_st("st_shape_negative", m)
    expect_gen_fail(d, [name, "shape[0] is -256"])


@case
def st_shape_overflow():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["shape"] = [2 ** 40, 2 ** 40]
    d = with_st("st_shape_overflow", m)
    expect_gen_fail(d, [name, "too many elements"])


@case
def st_shape_too_many_dims():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["shape"] = [1] * 8 + [256]
    d = with_st("st_shape_too_many_dims", m)
    expect_gen_fail(d, [name, "shape has 9 dims"])


@case
def st_shape_not_a_list():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["shape"] = 256
    d = with_st("st_shape_not_a_list", m)
    expect_gen_fail(d, [name, "is not an array"])


@case
def st_entry_missing_key():
    name = PREFIX + "norm.weight"

    def m(st):
        del st.get(name)["dtype"]
    d = with_st("st_entry_missing_key", m)
    expect_gen_fail(d, [name, "missing key 'dtype'"])


@case
def st_entry_unknown_key():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["stride"] = [1]
    d = with_st("st_entry_unknown_key", m)
    expect_gen_fail(d, [name, "unknown key 'stride'"])


@case
def st_entry_not_object():
    name = PREFIX + "norm.weight"

    def m(st):
        for kv in st.items:
            if kv[0] == name:
                kv[1] = "BF16"
    d = with_st("st_entry_not_object", m)
    expect_gen_fail(d, [name, "is not an object"])


@case
def st_metadata_not_strings():
    def m(st):
        st.get("__metadata__")["format"] = 7
    d = with_st("st_metadata_not_strings", m)
    expect_gen_fail(d, ["__metadata__ value 'format'"])


@case
def st_duplicate_tensor_name():
    name = PREFIX + "norm.weight"

    def m(st):
        st.items.append([name, dict(st.get(name))])
    d = with_st("st_duplicate_tensor_name", m)
    expect_gen_fail(d, [name])


# (the same name twice with the same offsets is reported as the tensor
# overlapping itself; the name is all this case requires)


@case
def st_duplicate_tensor_name_other_data():
    # the same name twice, pointing at different bytes
    name = PREFIX + "norm.weight"
    other = PREFIX + "layers.0.input_layernorm.weight"

    def m(st):
        st.items.append([name, dict(st.get(other))])
        st.remove(other)
    d = with_st("st_duplicate_tensor_name_other_data", m)
    expect_gen_fail(d, [f"duplicate tensor name '{name}'"])


@case
def st_unknown_dtype():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["dtype"] = "BF17"
    d = with_st("st_unknown_dtype", m)
    expect_gen_fail(d, [name, "unknown dtype \"BF17\""])


@case
def st_dtype_not_a_string():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["dtype"] = 16
    d = with_st("st_dtype_not_a_string", m)
    expect_gen_fail(d, [name, "unknown dtype 16"])


@case
def st_missing_index_k_proj():
    name = PREFIX + "layers.1.self_attn.index_k_proj.weight"
    d = with_st("st_missing_index_k_proj", lambda st: st.remove(name))
    expect_gen_fail(d, [f"checkpoint is missing tensor {name}"])


@case
def st_missing_expert():
    name = PREFIX + "layers.2.block_sparse_moe.experts.7.w2.weight"
    d = with_st("st_missing_expert", lambda st: st.remove(name))
    expect_gen_fail(d, [f"checkpoint is missing tensor {name}"])


@case
def st_missing_lm_head():
    d = with_st("st_missing_lm_head", lambda st: st.remove("language_model.lm_head.weight"))
    expect_gen_fail(d, ["checkpoint has no lm_head"])


@case
def st_missing_embedding():
    d = with_st("st_missing_embedding",
                lambda st: st.rename(PREFIX + "embed_tokens.weight", "embed.weight"))
    expect_gen_fail(d, ["checkpoint has no embedding"])


@case
def st_missing_routing_bias():
    name = PREFIX + "layers.1.block_sparse_moe.e_score_correction_bias"
    d = with_st("st_missing_routing_bias", lambda st: st.remove(name))
    expect_gen_fail(d, [f"checkpoint is missing tensor {name}"])


@case
def st_wrong_shape_transposed():
    # same bytes, transposed: only the shape is wrong for the model
    name = PREFIX + "layers.0.self_attn.q_proj.weight"

    def m(st):
        assert st.get(name)["shape"] == [512, 256]
        st.get(name)["shape"] = [256, 512]
    d = with_st("st_wrong_shape_transposed", m)
    expect_gen_fail(d, [f"tensor {name} has shape [256, 512]; expected [512, 256]"])


@case
def st_wrong_shape_smaller():
    name = PREFIX + "norm.weight"

    def m(st):
        b, e = st.get(name)["data_offsets"]
        st.get(name)["shape"] = [128]
        st.get(name)["data_offsets"] = [b, b + 256]
    d = with_st("st_wrong_shape_smaller", m)
    expect_gen_fail(d, [f"tensor {name} has shape [128]; expected [256]"])


@case
def st_wrong_shape_extra_dim():
    name = PREFIX + "layers.0.input_layernorm.weight"

    def m(st):
        st.get(name)["shape"] = [1, 256]
    d = with_st("st_wrong_shape_extra_dim", m)
    expect_gen_fail(d, [f"tensor {name} has shape [1, 256]; expected [256]"])


@case
def st_wrong_dtype_norm_f16():
    name = PREFIX + "layers.0.input_layernorm.weight"

    def m(st):
        assert st.get(name)["dtype"] == "BF16"
        st.get(name)["dtype"] = "F16"
    d = with_st("st_wrong_dtype_norm_f16", m)
    expect_gen_fail(d, [f"tensor {name} has dtype F16; expected BF16"])


@case
def st_wrong_dtype_linear_f16():
    name = PREFIX + "layers.2.self_attn.o_proj.weight"

    def m(st):
        st.get(name)["dtype"] = "F16"
    d = with_st("st_wrong_dtype_linear_f16", m)
    expect_gen_fail(d, [f"tensor {name} has dtype F16"])


@case
def st_router_bf16():
    name = PREFIX + "layers.1.block_sparse_moe.gate.weight"

    def m(st):
        e = st.get(name)
        assert e["dtype"] == "F32" and e["shape"] == [8, 256]
        b, _ = e["data_offsets"]
        e["dtype"] = "BF16"
        e["data_offsets"] = [b, b + 8 * 256 * 2]
    d = with_st("st_router_bf16", m)
    expect_gen_fail(d, [f"tensor {name} has dtype BF16; expected F32"])


@case
def st_fp8_weight_without_scale():
    # an F8_E4M3 (MXFP8) weight needs its weight_scale_inv companion
    name = PREFIX + "layers.0.self_attn.q_proj.weight"

    def m(st):
        e = st.get(name)
        b, _ = e["data_offsets"]
        e["dtype"] = "F8_E4M3"
        e["data_offsets"] = [b, b + 512 * 256]
    d = with_st("st_fp8_weight_without_scale", m)
    expect_gen_fail(d, [name, "layers.0.self_attn.q_proj.weight_scale_inv"])


@case
def st_is_a_directory():
    d = copy_good("st_is_a_directory", weights=False)
    os.mkdir(os.path.join(d, ST_NAME))
    expect_gen_fail(d, [ST_NAME, "not a regular file"])


@case
def st_is_a_fifo():
    # a named pipe is not a regular file: it must be refused, not opened and
    # waited on (nothing ever writes to it)
    d = copy_good("st_is_a_fifo", weights=False)
    os.mkfifo(os.path.join(d, ST_NAME))
    expect_fail(gen_args(d), [ST_NAME, "not a regular file"], rc=1, timeout=10)


@case
def st_no_weights_at_all():
    d = copy_good("st_no_weights_at_all", weights=False)
    expect_gen_fail(d, ["no model.safetensors.index.json"])


@case
def st_two_files_no_index():
    d = copy_good("st_two_files_no_index", weights=False)
    for n in ("a.safetensors", "b.safetensors"):
        shutil.copyfile(os.path.join(H.GOOD, ST_NAME), os.path.join(d, n))
    expect_gen_fail(d, ["holds 2 *.safetensors files", "model.safetensors.index.json"])


def _sharded(name, weight_map_fn, shards):
    """The good weights as shard files plus an index whose weight_map is
    weight_map_fn(list of tensor names)."""
    d = copy_good(name, weights=False)
    for s in shards:
        shutil.copyfile(os.path.join(H.GOOD, ST_NAME), os.path.join(d, s))
    names = [k for k, _ in good_st().items if k != "__metadata__"]
    index = {"metadata": {}, "weight_map": weight_map_fn(names)}
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return d


@case
def st_index_missing_shard():
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    d = _sharded("st_index_missing_shard",
                 lambda names: {n: (s1 if i % 2 else s2) for i, n in enumerate(names)}, [s1])
    expect_gen_fail(d, [s2, "cannot open"])


@case
def st_index_not_json():
    d = copy_good("st_index_not_json")
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        f.write("{ weight_map: ")
    expect_gen_fail(d, ["model.safetensors.index.json", "not a JSON object"])


@case
def st_index_no_weight_map():
    d = copy_good("st_index_no_weight_map")
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}}, f)
    expect_gen_fail(d, ["weight_map", "is not a non-empty object"])


@case
def st_index_path_escape():
    d = _sharded("st_index_path_escape",
                 lambda names: {n: "../good/model.safetensors" for n in names}, [])
    expect_gen_fail(d, ["is not a plain file name in the folder"])


@case
def st_index_wrong_shard():
    # two distinct shards; the index claims one tensor lives in the other
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    d = copy_good("st_index_wrong_shard", weights=False)
    st = good_st()
    names = [k for k, _ in st.items if k != "__metadata__"]
    first, second = names[:len(names) // 2], names[len(names) // 2:]
    for shard, keep in ((s1, first), (s2, second)):
        part = good_st()
        part.items = [kv for kv in part.items if kv[0] == "__metadata__" or kv[0] in keep]
        part.write(os.path.join(d, shard))
    wm = {n: s1 for n in first}
    wm.update({n: s2 for n in second})
    liar = second[0]
    wm[liar] = s1
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": wm}, f)
    expect_gen_fail(d, [liar, "which does not hold it"])


@case
def st_index_tensor_in_two_shards():
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    d = _sharded("st_index_tensor_in_two_shards",
                 lambda names: {n: (s1 if i % 2 else s2) for i, n in enumerate(names)}, [s1, s2])
    expect_gen_fail(d, ["appears in two shards"])


if __name__ == "__main__":
    sys.exit(main("test_bad_input"))
