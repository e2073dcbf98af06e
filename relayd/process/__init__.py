"""What belongs to the process, not to one wing: the process-wide settings and the typed values built
from them (C{settings}, C{browsers}, C{cors}), and what relayd asks of its host (C{host}: the open-file
limit, sd_notify, the garbage collector's policy)."""
