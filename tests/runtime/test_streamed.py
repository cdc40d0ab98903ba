"""A streamed component finds every weight on the device when it is used, also when it is not called through its
forward: a VAE's ``encode`` and ``decode`` (their tiled paths too) reach its first and last convolutions, which sit
outside its block lists, directly. (Found on an H200 under 16 GiB: the streamed VAE's ``conv_in`` stayed on the host.)
On the CPU the copies move nothing, so the test watches which tensors the stream says are on the device as each
module runs."""

from __future__ import annotations

import torch
from tiny_models import tiny_vae

from ditq.runtime.offload import _Streamed


def _decode_encode(vae: torch.nn.Module, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        latents = vae.encode(image).latent_dist.mode()
        return latents, vae.decode(latents).sample


def test_a_streamed_vae_has_each_weight_on_the_device_when_encode_and_decode_use_it() -> None:
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    plain = tiny_vae()
    expected = _decode_encode(plain, image)

    vae = tiny_vae()
    stream = _Streamed(vae, torch.device("cpu"))
    assert stream.rest  # conv_in, conv_out, norms outside the block lists
    missing: list[str] = []

    def check(module: torch.nn.Module, _args: object, name: str) -> None:
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if any(id(t) not in stream.onloaded for t in own):
            missing.append(name)

    for name, module in vae.named_modules():  # registered after the stream's hooks, so they run after them
        module.register_forward_pre_hook(lambda m, a, name=name: check(m, a, name))
    for tiling in (False, True):
        if tiling:
            for model in (vae, plain):  # 32-pixel tiles over the 64-pixel image
                model.enable_tiling()
                model.tile_sample_min_size, model.tile_latent_min_size = 32, 16
            expected = _decode_encode(plain, image)
        latents, decoded = _decode_encode(vae, image)
        assert missing == [], f"used while on the host (tiling {tiling}): {missing[:5]}"
        assert stream.onloaded == set()  # every tensor dropped again once its module ended
        assert torch.equal(latents, expected[0]) and torch.equal(decoded, expected[1])


def test_inside_the_components_forward_its_rest_stays_on_the_device_until_the_forward_ends() -> None:
    vae = tiny_vae()
    stream = _Streamed(vae, torch.device("cpu"))
    conv_in = vae.encoder.conv_in.weight
    seen: list[bool] = []
    vae.decoder.conv_out.register_forward_hook(lambda *_: seen.append(id(conv_in) in stream.onloaded))
    with torch.no_grad():
        vae(torch.zeros(1, 3, 32, 32))  # forward: encode then decode
    assert seen == [True]  # conv_in still held when the decoder ends: the forward holds the rest once
    assert stream.onloaded == set()
