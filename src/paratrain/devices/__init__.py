"""What the machine offers, --devices specs, precision policies."""
