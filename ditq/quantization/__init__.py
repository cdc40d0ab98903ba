"""The quantize stage: a diffusers model directory in, a compressed-tensors artifact out, and its verification.

- ``targets``: which Linears of a component are quantized, read from the model's own structure, and why not the
  rest (and which modules a pipeline never reads);
- ``quantizer``: the offline quantizer (``ditq quantize``, ``ditq.quantize``), streaming each component through
  ``rewrite``;
- ``links``: how the source's entries it does not rewrite are held: a relative link, a copy or an absolute link;
- ``plan_file`` / ``plan_apply``: the mixed-precision plan file (PLAN.json) it reads, and its layers applied;
- ``in_memory``: ``ditq.quantize_`` (a loaded model's Linears quantized in place, by the same rule and code) and
  ``ditq.save`` (the quantizer writing its artifact with those layers);
- ``verifier``: ``ditq verify`` (``ditq.verify``), digests and every quantized tensor decoded twice.

The stage is named ``quantization``, not ``quantize``, so that ``ditq.quantize`` stays the function whether or not
this package has been imported: importing a submodule sets it as an attribute of its parent, which would hide a
function of the same name.
"""
