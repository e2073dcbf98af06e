"""A fourth wing for tests/test_wing.py: one package, added to relayd.tap.WINGS with one line.

It imports relayd's plumbing only (relayd.base.config, relayd.web, relayd.wing), as a wing must.
"""
