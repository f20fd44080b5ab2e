"""Fixtures of the Hugging Face tests (the tiny DeepSeek-V3 of ``tools/make_hf_fixture.py``)."""

import pytest
from hf_fixture import FIXTURES


@pytest.fixture
def fixtures():
    return FIXTURES
