"""Session-wide tiny Hugging Face checkpoints for the model/hf tests."""

from __future__ import annotations

import pytest

from . import hf_cases as H


@pytest.fixture(scope="session")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="session")
def llava_clip_llama(hf_root):
    """CLIP (feature layer -2, `default`) + Llama with rope theta 5e5 and RMS eps 1e-5."""
    return H.write_llava(hf_root, vision="clip", llm="llama", layer=-2, select="default", seed=11,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e5}, rms_norm_eps=1e-5)


@pytest.fixture(scope="session")
def llava_siglip_qwen2(hf_root):
    """SigLIP (last layer, `full`) + Qwen2 (q/k/v biases) with tied embeddings."""
    return H.write_llava(hf_root, vision="siglip", llm="qwen2", layer=-1, select="full", seed=12, tie=True)


@pytest.fixture(scope="session")
def llava_clip_mistral(hf_root):
    """CLIP + Mistral with a sliding window shorter than the samples."""
    return H.write_llava(hf_root, vision="clip", llm="mistral", layer=-2, select="default", seed=13,
                         sliding_window=8)


@pytest.fixture(scope="session")
def llava_next(hf_root):
    """LLaVA-NeXT: CLIP (feature layer -2, `default`) + Mistral, five tile grids."""
    return H.write_llava_next(hf_root, seed=16)


@pytest.fixture(scope="session")
def llava_onevision(hf_root):
    """LLaVA-OneVision: SigLIP (last layer, `full`) + Qwen2, grids to 3x3 tiles, anyres_max_4."""
    return H.write_llava_onevision(hf_root, seed=17)


@pytest.fixture(scope="session")
def internvl(hf_root):
    """InternVL: InternViT (28-px tiles, 2x2 pixel shuffle) + Qwen2, 1..6 tiles and the thumbnail."""
    return H.write_internvl(hf_root, seed=18)


@pytest.fixture(scope="session")
def internvl_qwen3(hf_root):
    """InternVL 3.5: the same tower + Qwen3 (q/k norms, head_dim 16) with tied embeddings."""
    return H.write_internvl(hf_root, seed=19, llm="qwen3", tie=True)


@pytest.fixture(scope="session")
def gemma3(hf_root):
    """Gemma 3: SigLIP (56-px images, 16 tokens each) + a 4-layer Gemma 3 decoder, sliding and full layers."""
    return H.write_gemma3(hf_root, seed=20)


@pytest.fixture(scope="session")
def qwen2_vl(hf_root):
    return H.write_qwen2_vl(hf_root, seed=14)


@pytest.fixture(scope="session")
def qwen3_vl(hf_root):
    return H.write_qwen3_vl(hf_root, seed=16)


@pytest.fixture(scope="session")
def qwen2_audio(hf_root):
    return H.write_qwen2_audio(hf_root, seed=15)


@pytest.fixture(scope="session")
def qwen2_5_vl(hf_root):
    return H.write_qwen2_5_vl(hf_root, seed=16)


@pytest.fixture(scope="session")
def qwen2_5_omni(hf_root):
    return H.write_qwen2_5_omni(hf_root, seed=17)


@pytest.fixture(scope="session")
def unimodal(hf_root):
    """Unimodal checkpoints by kind, written on first use."""
    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = H.write_unimodal(hf_root, kind, seed=20 + len(made))
        return made[kind]

    return get
