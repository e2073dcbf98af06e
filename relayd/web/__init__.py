"""HTTP plumbing shared by every wing; it knows no protocol."""
