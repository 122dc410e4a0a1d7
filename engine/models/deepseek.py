"""DeepSeek-V2/V2-Lite, DeepSeek-V3/R1 and Kimi K2 (a V3): the Llama block with latent attention
(latent_attention.py, picked by the config's `kv_lora_rank`) and, after `first_k_dense_replace` dense
layers, a mixture of experts routed by DeepSeek's grouped top-k (moe/spec.py's "softmax_grouped" for V2,
"sigmoid_grouped" for V3) beside an ungated shared expert. The checkpoints call that expert
`shared_experts`; the multi-token-prediction layers they append (`num_nextn_predict_layers`, numbered
from `num_hidden_layers` on) are read past and not run."""

import re

from tandem.engine.models.common import CausalLM

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekV2ForCausalLM(CausalLM):
    checkpoint_renames = ((r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),)

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """The MTP layers: numbered past the decoder's layers."""
        found = _LAYER.match(name)
        return found is not None and int(found.group(1)) >= self.config.num_layers


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
