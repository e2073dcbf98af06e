"""relayd's logs: the secret scrubber (C{scrub}), access lines (C{access}), the JSON and text observers (C{json})."""
