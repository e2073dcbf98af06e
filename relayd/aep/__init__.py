"""AEP event relay wing: envelope checks, attr-match filters, capture downlevel, and the relay."""
