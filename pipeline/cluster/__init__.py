"""The storage workers as the control plane sees them: signing, the client, membership, mDNS."""
