"""The fence: the one package that reaches into the private state of the libraries relayd runs on.

One module per library it reads (C{tcp}: twisted.internet's TCP transports; C{reactor}: the epoll
reactor's event dispatch; C{web}: twisted.web;
C{logger}: twisted.logger and twistd's exit status; C{autobahn}; C{txredisapi}; C{prometheus}: prometheus_client's counter values; C{detect}: how each
entry finds out, at import, whether the installed release has what it relies on). Every entry is
feature-detected and has a public fallback (or the library's own plainer behaviour); tests/compat/
checks each one against the installed release and fails any module outside this package that reaches
in. This package is at the bottom of relayd's layers (pyproject.toml's C{layers} contract): it imports
nothing of relayd's but its own modules.
"""
