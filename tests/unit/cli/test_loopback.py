"""The CLI's requests to a local API bypass the environment's proxies; those to any other host keep them."""

from __future__ import annotations

import pytest

from app.cli.loopback import is_loopback, trust_env


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.3.4.5:1/v1", "http://[::1]:8000",
                                 "http://localhost:8000", "https://LOCALHOST.", "http://api.localhost:80"])
def test_loopback_urls_take_no_proxy(url):
    assert is_loopback(url) and trust_env(url) is False


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "https://coserve.example.com", "http://[2001:db8::1]:80",
                                 "http://localhost.example.com", "http://[::1", "not a url"])
def test_other_urls_keep_the_proxy(url):
    assert not is_loopback(url) and trust_env(url) is True
