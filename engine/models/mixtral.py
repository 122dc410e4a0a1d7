"""Mixtral: the Mistral block with a mixture of experts in every layer, softmax over the experts, then
the top 2, renormalized. Hub checkpoints keep the experts under `block_sparse_moe` as w1 (gate), w3 (up)
and w2 (down); transformers' fused layout (`mlp.experts.gate_up_proj`) needs no renaming."""

from tandem.engine.models.common import CausalLM


class MixtralForCausalLM(CausalLM):
    checkpoint_renames = (
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
        (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
        (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    )
