"""The tiny random-weight models: one config per supported family, hidden 64, 4-6 layers,
SmolLM2's vocabulary.

They are how the suites run every family on a CPU in seconds: `backends.models.tiny_folder`
builds each once (transformers, from its config and seed, float32) into a Hugging Face folder both
runtimes load, and `backends.models.resolve` knows their names ("tiny-llama", ...; "-q4" / "-q8"
for their MLX-quantized copies). Adding a family that needs no code is adding its config here.
Plain data, kept apart from the builder (which needs the cache folder and SmolLM2's tokenizer) so
the ~190 lines of configs do not bury how a name finds its files.

Dependency rules: none; imports nothing of the project.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TINY_MODELS", "TINY_SEEDS"]


def _tiny_common(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        # Shares SmolLM2's vocabulary so tiny models take the same real-text token ids.
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        # Random weights at the usual 0.02 give nearly flat logits, where argmax and greedy tokens
        # would hinge on 1e-7 noise; a wider init makes next-token choices decisive.
        "initializer_range": 0.2,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    cfg.update(over)
    return cfg


# A window longer than a 128-token page: evicting the newest page must leave the window alone.
_TINY_WINDOW = 160
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
_QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1], "mrope_interleaved": True}

TINY_MODELS: dict[str, dict[str, Any]] = {
    "tiny-llama": _tiny_common(model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "tiny-qwen3": _tiny_common(model_type="qwen3", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "tiny-qwen3-next": _tiny_common(
        model_type="qwen3_next", head_dim=32, layer_types=["linear_attention"] * 3 + ["full_attention"], **_GDN,
        **_MOE, shared_expert_intermediate_size=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    ),
    "tiny-qwen2": _tiny_common(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "tiny-qwen3-moe": _tiny_common(model_type="qwen3_moe", **_MOE, decoder_sparse_step=1, mlp_only_layers=[],
                                   norm_topk_prob=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "tiny-qwen3-5": _tiny_common(model_type="qwen3_5_text", head_dim=32,
                                 layer_types=["linear_attention"] * 3 + ["full_attention"], **_GDN,
                                 tie_word_embeddings=False, rope_parameters=dict(_QWEN35_ROPE)),
    "tiny-qwen3-5-moe": _tiny_common(model_type="qwen3_5_moe_text", head_dim=32,
                                     layer_types=["linear_attention"] * 3 + ["full_attention"], **_GDN, **_MOE,
                                     shared_expert_intermediate_size=64, tie_word_embeddings=False,
                                     rope_parameters=dict(_QWEN35_ROPE)),
    "tiny-gemma3": _tiny_common(model_type="gemma3_text", layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                sliding_window=_TINY_WINDOW, query_pre_attn_scalar=16,
                                hidden_activation="gelu_pytorch_tanh",
                                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                                 "sliding_attention": {"rope_type": "default",
                                                                       "rope_theta": 10000.0}}),
    "tiny-gemma4": _tiny_common(model_type="gemma4_text", num_hidden_layers=6,
                                layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                                sliding_window=_TINY_WINDOW, global_head_dim=32, num_kv_shared_layers=3,
                                hidden_size_per_layer_input=16, vocab_size_per_layer_input=49152,
                                final_logit_softcapping=30.0, use_double_wide_mlp=False,
                                hidden_activation="gelu_pytorch_tanh",
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "proportional",
                                                                    "rope_theta": 1000000.0,
                                                                    "partial_rotary_factor": 0.25}}),
    "tiny-gpt-oss": _tiny_common(model_type="gpt_oss", layer_types=["sliding_attention", "full_attention"] * 2,
                                 sliding_window=_TINY_WINDOW, num_local_experts=4, num_experts_per_tok=2,
                                 intermediate_size=64, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                  "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                  "original_max_position_embeddings": 4096}),
    "tiny-glm4-moe": _tiny_common(model_type="glm4_moe", use_qk_norm=True, n_routed_experts=4, n_shared_experts=1,
                                  num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1,
                                  n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                                  tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.5}),
    "tiny-mistral": _tiny_common(model_type="mistral", sliding_window=None,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "tiny-ministral": _tiny_common(model_type="ministral", layer_types=["sliding_attention", "full_attention"] * 2,
                                   sliding_window=_TINY_WINDOW,
                                   rope_parameters={"rope_type": "default", "rope_theta": 100000000.0}),
    "tiny-ministral3": _tiny_common(model_type="ministral3",
                                    rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                                                     "original_max_position_embeddings": 256, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                                                     "llama_4_scaling_beta": 0.1, "max_position_embeddings": 4096}),
    "tiny-nemotron-h": {k: v for k, v in _tiny_common(
        model_type="nemotron_h", layers_block_type=["linear_attention", "full_attention", "mlp",
                                                    "linear_attention", "full_attention", "moe"],
        mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=16, conv_kernel=4, chunk_size=16,
        layer_norm_epsilon=1e-5, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=64, moe_shared_expert_intermediate_size=64, tie_word_embeddings=False,
        use_mamba_kernels=False).items() if k != "num_hidden_layers"},
}

# The seed each tiny model's weights are drawn with.
TINY_SEEDS = {name: 1101 + i for i, name in enumerate(TINY_MODELS)}
