"""gpt-oss (20b, 120b): the Llama block with biases on q, k, v and o, a learned sink logit per head, a
window on the layers `layer_types` marks (every other one), YaRN rope, and a mixture of experts on every
layer whose router has a bias and takes the top k logits before its softmax, and whose experts run a
clamped SwiGLU with biases (MoESpec's gpt-oss options). The router is `mlp.router` in checkpoints and
`mlp.gate` here; the experts' tensors keep their names (transformers' fused layout, or the hub's MXFP4
blocks and scales, read through quant/mxfp4.py)."""

from tandem.engine.models.common import CausalLM
from tandem.engine.models.context import Traits


class GptOssForCausalLM(CausalLM):
    traits = Traits(o_proj_bias=True, attention_sinks=True)
    checkpoint_renames = ((r"\.mlp\.router\.", ".mlp.gate."),)
