# Two entry points for a fresh machine: `make demo` and `make test`.
# Each bootstraps .venv from the project's own files; nothing else to install.
# `make install` puts gpud on a node as a systemd service (see docs/running.md).
PYTHON ?= python3
VENV := .venv
# The demo needs gpud and its client alone; the tests add Ray, Airflow, pytest (with xdist), ruff and mypy.
BASE := $(VENV)/.base
STAMP := $(VENV)/.installed
# setuptools warns at length that an editable install is one; nothing to act on.
PIP_QUIET := PYTHONWARNINGS='ignore:Editable installation' $(VENV)/bin/python -m pip install --quiet

# Where `make install` puts things. DESTDIR stages the whole tree under another
# root for packaging; every path written into a file or link is the final one.
DESTDIR ?=
PREFIX = /opt/gpud
BINDIR = /usr/local/bin
UNITDIR = /etc/systemd/system
SYSUSERSDIR = /usr/lib/sysusers.d
TMPFILESDIR = /usr/lib/tmpfiles.d

VENVDIR = $(DESTDIR)$(PREFIX)
# The interpreter the service's environment is built on (its python links to it): the
# distribution's, not the first python3 in PATH, which for root with pyenv, uv or conda lies
# under /root, hidden from the service by ProtectHome=yes. `make install PYTHON=...` names
# another; install/check_python.py refuses one that the service or gpuctl's users could not run.
ifeq ($(origin PYTHON),file)
INSTALL_PYTHON = /usr/bin/python3
else
INSTALL_PYTHON = $(PYTHON)
endif
# What the two builds read: each project's metadata and packages, the README that
# gpud's metadata names, the client's build step and the generator it runs (client/setup.py,
# client/tools), and the licence files setuptools picks up by name.
LICENCES = LICEN[CS]E* COPYING* NOTICE* AUTHORS*
BUILD_SOURCES = pyproject.toml README.md gpud client/pyproject.toml client/setup.py client/tools client/gpud_client \
	$(wildcard $(LICENCES) $(addprefix client/,$(LICENCES)))
# Local pip config may say more; only the version nag is turned off.
PIP = PIP_DISABLE_PIP_VERSION_CHECK=1 '$(VENVDIR)/bin/python' -m pip

.PHONY: demo test test-fast check bench clean install uninstall

$(BASE): pyproject.toml client/pyproject.toml
	@echo "make: installing gpud and gpud-client into $(VENV) (once; about 20 s)"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PIP_QUIET) -e ./client -e .
	touch $(BASE)

$(STAMP): $(BASE)
	@echo "make: installing what the tests need into $(VENV): Ray, Airflow, the Kubernetes agent's gRPC and client, pytest, mypy (once; about a minute)"
	$(PIP_QUIET) -e './client[ray,airflow]' -e '.[test,k8s]'
	touch $(STAMP)

# The sync client is generated from the asyncio one and ignored by git (client/tools/unasync.py).
# Installing the client writes it (client/setup.py); this keeps it current while aio.py changes,
# without reinstalling. The generator leaves a current file as it is, so touch it.
SYNC_CLIENT := client/gpud_client/client.py
$(SYNC_CLIENT): client/gpud_client/aio.py client/tools/unasync.py
	$(PYTHON) client/tools/unasync.py
	touch $@

demo: $(BASE) $(SYNC_CLIENT)
	$(VENV)/bin/python -m gpud.tools.demo

# Two workers: a test file (and Ray's two files) stays on one; see docs/layout.md.
test: $(STAMP) $(SYNC_CLIENT)
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadgroup

# Lint and layout (ruff, rules in pyproject.toml) and types (mypy --strict on gpud, gpud_client, install
# and bench), outside pytest. It needs ruff and mypy but not Ray or Airflow: on a base install it adds
# the test tools alone.
check: $(BASE) $(SYNC_CLIENT)
	@[ -x $(VENV)/bin/ruff ] && [ -x $(VENV)/bin/mypy ] || $(PIP_QUIET) -e '.[test]'
	$(VENV)/bin/ruff check gpud gpud_k8s client bench tests examples install
	$(VENV)/bin/ruff format --check gpud gpud_k8s client bench tests examples install
	$(VENV)/bin/python -m mypy
	$(VENV)/bin/python client/tools/unasync.py --check

# The rules and the in-process tests only (markers in pyproject.toml): a quick check while working.
test-fast: $(STAMP) $(SYNC_CLIENT)
	$(VENV)/bin/python -m pytest -q -m "core or inprocess"

bench: $(STAMP) $(SYNC_CLIENT)
	$(VENV)/bin/python bench/handoff.py

clean:
	rm -rf $(VENV)

# Its own virtual environment, so it works where the system Python refuses pip
# (PEP 668). pip builds a local project inside its directory, so it builds from
# a copy of BUILD_SOURCES: `sudo make install` leaves nothing root-owned in the
# checkout, and no stale build/ from an earlier build reaches the installed package. Runs no
# systemctl or systemd-sysusers: that is the operator's step (docs/running.md), and it
# keeps DESTDIR builds free of side effects on this machine.
install:
	@case '$(PREFIX)' in /?*) ;; *) echo 'PREFIX must be an absolute path of its own, e.g. /opt/gpud' >&2; exit 1;; esac
	@command -v '$(INSTALL_PYTHON)' >/dev/null || { echo "make install: there is no $(INSTALL_PYTHON); install the distribution's python3 and python3-venv, or name one with PYTHON=/path/to/python3" >&2; exit 1; }
	@'$(INSTALL_PYTHON)' install/check_python.py '$(INSTALL_PYTHON)'
# umask 022 for what is made without a mode of its own: the service's user and gpuctl's users read it.
	umask 022 && '$(INSTALL_PYTHON)' -m venv '$(VENVDIR)'
	umask 022 && src=$$(mktemp -d) && trap 'rm -rf "$$src"' EXIT && \
	  tar -c --exclude=__pycache__ $(BUILD_SOURCES) | tar -x -C "$$src" && \
	  $(PIP) install --quiet "$$src/client" "$$src"
# With DESTDIR, the scripts' #! lines, activate* and pyvenv.cfg name the staged path: make them name the final one.
	if [ -n '$(DESTDIR)' ]; then \
	  staged=$$(printf '%s\n' '$(VENVDIR)' | sed 's/[][\.*^$$|]/\\&/g'); \
	  find '$(VENVDIR)/bin' '$(VENVDIR)/pyvenv.cfg' -type f -exec grep -lIF '$(VENVDIR)' {} + \
	    | while read -r f; do sed -i "s|$$staged|$(PREFIX)|g" "$$f"; done; \
	fi
	install -d '$(DESTDIR)$(BINDIR)' '$(DESTDIR)$(UNITDIR)' '$(DESTDIR)$(SYSUSERSDIR)' '$(DESTDIR)$(TMPFILESDIR)'
	ln -sfn '$(PREFIX)/bin/gpud' '$(DESTDIR)$(BINDIR)/gpud'
	ln -sfn '$(PREFIX)/bin/gpuctl' '$(DESTDIR)$(BINDIR)/gpuctl'
	install -m644 systemd/gpud.service systemd/gpud.socket '$(DESTDIR)$(UNITDIR)/'
	sed -i 's|^ExecStart=[^ ]*|ExecStart=$(BINDIR)/gpud|' '$(DESTDIR)$(UNITDIR)/gpud.service'
	install -m644 systemd/gpud.sysusers.conf '$(DESTDIR)$(SYSUSERSDIR)/gpud.conf'
	install -m644 systemd/gpud.tmpfiles.conf '$(DESTDIR)$(TMPFILESDIR)/gpud.conf'

# What install made, nothing more: /etc/gpud and /var/lib/gpud (config and
# allocations) stay. A link is removed only if it is ours.
uninstall:
	for name in gpud gpuctl; do \
	  link='$(DESTDIR)$(BINDIR)'/$$name; \
	  if [ "$$(readlink "$$link")" = '$(PREFIX)/bin/'$$name ]; then rm -f "$$link"; fi; \
	done
	rm -f '$(DESTDIR)$(UNITDIR)/gpud.service' '$(DESTDIR)$(UNITDIR)/gpud.socket'
	rm -f '$(DESTDIR)$(SYSUSERSDIR)/gpud.conf' '$(DESTDIR)$(TMPFILESDIR)/gpud.conf'
	case '$(PREFIX)' in /?*) if [ -f '$(VENVDIR)/pyvenv.cfg' ]; then rm -rf '$(VENVDIR)'; fi;; esac
