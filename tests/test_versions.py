"""The supported megatron-core range, checked at import with a message that names it."""

import pytest

from megatron_siamese import versions


@pytest.mark.parametrize("text,expected", [("0.16.1", (0, 16, 1)), ("0.19.2rc1", (0, 19, 2)),
                                           ("0.18.2+local", (0, 18, 2)), ("1.0", (1, 0, 0))])
def test_release_reads_the_numeric_version(text, expected):
    assert versions.release(text) == expected


@pytest.mark.parametrize("found,supported", [("0.16.0", False), ("0.16.1", True), ("0.19.2", True),
                                             ("0.20.0rc0", False), ("1.0.0", False)])
def test_the_range_is_0_16_1_to_0_19_x(found, supported):
    assert (versions.unsupported_reason(found) is None) == supported


def test_an_unsupported_release_fails_at_import_naming_the_range(monkeypatch):
    monkeypatch.setattr(versions, "installed_megatron_core", lambda: "0.15.3")
    monkeypatch.delenv(versions.UNTESTED_ENV, raising=False)
    with pytest.raises(ImportError, match=r">= 0\.16\.1, < 0\.20.*0\.15\.3 is installed.*MEGATRON_SIAMESE_UNTESTED_MEGATRON=1"):
        versions.check_megatron_core()
    monkeypatch.setenv(versions.UNTESTED_ENV, "1")  # the user's own risk: a warning instead
    with pytest.warns(UserWarning, match="0.15.3 is installed"):
        versions.check_megatron_core()


def test_the_installed_release_is_supported():
    assert versions.unsupported_reason(versions.installed_megatron_core()) is None
