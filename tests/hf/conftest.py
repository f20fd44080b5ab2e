"""Fixtures of the Hugging Face tests: ``fixtures`` is the tiny DeepSeek-V3 of
``tools/make_hf_fixture.py`` (the Qwen3-MoE one is ``hf_fixture.QWEN3``)."""

import pytest
from hf_fixture import FIXTURES


@pytest.fixture
def fixtures():
    return FIXTURES
