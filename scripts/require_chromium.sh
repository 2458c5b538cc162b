#!/usr/bin/env bash
# The API page's test (tests/integration/test_docs_page.py) opens it in a real headless browser:
# Debian's Chromium, driven by Playwright over the DevTools protocol (no browser download).
set -euo pipefail
bash "$(dirname "$0")/apt_install.sh" chromium chromium
