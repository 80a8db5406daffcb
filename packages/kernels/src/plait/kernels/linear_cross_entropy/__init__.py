"""Linear + cross-entropy without materialising the ``[N, V]`` logits.

The loss is computed block by block: the tokens are split into chunks and the vocabulary into
blocks; each ``[chunk, block]`` logit tile comes from one matmul, is folded into a running
(max, sum-exp, target-logit) per token and thrown away. The backward recomputes each tile, turns
it into ``dlogits`` in place (``softmax - onehot`` with z-loss / soft-cap terms), and feeds it to
the two gradient matmuls: ``dhidden += dlogits @ W_blk`` (fp32 accumulator per token chunk) and
``dW_blk += dlogits^T @ hidden_chunk`` (written straight into the gradient). Peak extra memory is
the gradients plus one tile and one fp32 chunk accumulator.

One-pass mode (``grad_in_forward``; the default whenever the loss is reduced to a scalar, no lse is
returned, no process group is given and a gradient is wanted): the forward computes the gradients
of the summed loss too, in one pass over token chunks with the whole vocabulary: per chunk one
``[chunk, V]`` logits matmul, one row kernel for the per-token loss and ``dlogits`` in place (it
sweeps each row twice), ``dhidden_c = dlogits @ W`` and ``dW (+)= dlogits^T @ hidden_c``. Three
passes over the classifier instead of four, and four launches per chunk; the backward only scales
the stored gradients by the incoming scalar (fp32 math, cast to the input dtype) and returns those
the grad-direction switch asks for (the work is done either way). Eager calls scale in place and
hand each stored gradient over once (a second backward asking for it again raises); inside a
compiled graph the custom op's backward returns scaled copies. ``dW``
accumulates over the chunks in the input dtype, like the two-pass backward (the op's docstring says
why). Peak extra memory in the forward: one ``[chunk, V]`` tile (<= 256M entries by default) plus
``dW`` and ``dhidden`` in the input dtype; the two gradients live until the backward (a schedule
that runs several forwards before their backwards holds a pair per forward: pass
``grad_in_forward=False`` there); compiled, the backward adds a scaled copy of each. Gradient work is done
even if no backward follows; under ``torch.no_grad()`` the two-pass forward runs.

With ``process_group`` the classifier is sharded over the vocabulary (rank r holds a contiguous
slice; slices may differ in size): per-token statistics are combined with two all-reduces and the
hidden gradient is all-reduced in the backward.

Matmuls run in the input dtype (cuBLAS on GPU); the softmax arithmetic is fp32 (Triton kernels on
CUDA / under ``TRITON_INTERPRET=1``, PyTorch otherwise). The op is the torch custom

Files: ``api.py`` (the entry point and its checks), ``reference.py`` (the materialising reference and
the reduction), ``two_pass.py`` (the ``plait::linear_cross_entropy`` forward/backward custom ops),
``tiles.py`` (the per-tile softmax steps in PyTorch), ``one_pass.py`` (the ``plait::linear_cross_entropy_fused`` ops),
``vocab_parallel.py`` (the process group and vocabulary offset of the sharded classifier) and
``cce.py`` (the cut-cross-entropy backend).
"""

from plait.kernels.linear_cross_entropy.api import linear_cross_entropy
from plait.kernels.linear_cross_entropy.reference import Reduction, linear_cross_entropy_reference

__all__ = ["Reduction", "linear_cross_entropy", "linear_cross_entropy_reference"]
