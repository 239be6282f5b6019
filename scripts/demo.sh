#!/usr/bin/env bash
# Serve the storefront demo on the embedded SQLite store: ./scripts/demo.sh [porch demo options]
source "$(dirname "$0")/_env.sh"
exec porch demo "$@"
