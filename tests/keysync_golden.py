"""Writes tests/data/keysync_reference.safetensors: KeySync's own code (a checkout named by
$LIPSTREAM_KEYSYNC_REFERENCE) run on the seeded tiny networks and inputs of keysync_reference.py. Rerun after
changing either; tests/test_keysync.py checks LipStream against the file, and against the checkout when named.

    LIPSTREAM_KEYSYNC_REFERENCE=path/to/keysync python tests/keysync_golden.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
import keysync_reference as ref  # noqa: E402

from lipstream.models.keysync import TINY, KeySyncNet  # noqa: E402

GOLDEN = Path(__file__).parent / "data" / "keysync_reference.safetensors"


def reference_outputs() -> dict[str, torch.Tensor]:
    out = {}
    for kind, channels in (("keyframe", 8), ("interpolation", 9)):
        config = type(TINY)(**{**TINY.to_dict(), "in_channels": channels})
        inp = ref.inputs(kind)
        names = KeySyncNet(config, features=inp["speech"].shape[-1], latent_size=inp["x"].shape[-1]).state_dict()
        state = ref.seeded(names, scale=0.2)
        network = ref.unet(config)
        prefix = "model.diffusion_model."
        network.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, strict=True)
        with torch.no_grad():
            out[f"unet_{kind}"] = ref.run_unet(network, inp["x"], inp["c_noise"], inp["audio"])
        out[f"sample_{kind}"] = ref.sample(config, ref.seeded(names, scale=0.05), inp["speech"], inp["latents"],
                                           inp["mask"], inp["reference"], inp["noise"])
    import json

    decoder = ref.sgm_decoder()
    ref.SGM_DECODER_SHAPES.write_text(json.dumps({k: list(v.shape) for k, v in decoder.state_dict().items()}))
    decoder.load_state_dict(ref.sgm_decoder_state(), strict=True)
    z = torch.randn(6, 4, 4, 4, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out["sgm_decoder_1"], out["sgm_decoder_3"] = decoder(z, timesteps=1), decoder(z, timesteps=3)

    from lipstream.models.wavlm import WavLM, WavLMConfig

    names = WavLM(WavLMConfig.from_dict(ref.WAVLM_CONFIG)).state_dict()
    with torch.no_grad():
        out["wavlm"] = ref.wavlm(ref.wavlm_state(names)).extract_features(ref.wavlm_speech()[None])[0]
    return out


if __name__ == "__main__":
    if ref.checkout() is None:
        sys.exit(f"set {ref.ENV_VAR} to a checkout of antonibigata/keysync (the folder holding sgm/)")
    save_file({k: v.contiguous() for k, v in reference_outputs().items()}, str(GOLDEN))
    print(f"wrote {GOLDEN}")
