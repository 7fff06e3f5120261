# `make demo`, `make check` and `make test` create (or reuse) .venv and install what each runs: one stamp
# per set, so a venv made for the demo installs the rest when `make test` comes.
# Torch: a torch already importable in the venv is kept (e.g. a user's CUDA build); a system-wide
# CUDA torch is reused through --system-site-packages; otherwise the CPU build torch==2.13.0.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
# what each target installs (pyproject.toml's extras). The demo needs none: its avatar's face comes with
# its example loop (a track file), so no face tracker runs.
DEMO_EXTRAS :=
CHECK_EXTRAS := test
TEST_EXTRAS := test,serve,postgres,dlib,pipecat,livekit,ray
# DWPose's reference modules for tests/test_dwpose.py (tests/dwpose_reference.py reads mmdet's and mmpose's
# files without importing those packages, which want mmcv's compiled ops): installed without their
# dependencies, which would pull a second OpenCV.
DWPOSE_REFERENCE := mmengine==0.10.7 mmcv-lite==2.0.1 mmdet==3.1.0 mmpose==1.1.0 addict yapf termcolor
stamp = $(VENV)/.lipstream-installed-$(1)

.PHONY: install browser postgres espeak demo show check test clean

install: $(call stamp,test)

# $(1): the extras; $(2): packages installed without their dependencies. The venv and torch first, then the
# package (editable) with those extras.
define install_extras
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then \
	    echo "reusing the system's CUDA torch"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else $(PYTHON) -m venv $(VENV); fi; \
	fi
	@$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e '.$(if $(1),[$(1)])'
	$(if $(2),$(PY) -m pip install -q --no-deps $(2))
	@touch $@
endef

$(call stamp,demo): pyproject.toml
	$(call install_extras,$(DEMO_EXTRAS))

$(call stamp,check): pyproject.toml Makefile
	$(call install_extras,$(CHECK_EXTRAS),$(DWPOSE_REFERENCE))

$(call stamp,test): pyproject.toml Makefile
	$(call install_extras,$(TEST_EXTRAS),$(DWPOSE_REFERENCE))

demo: $(call stamp,demo)
	$(PY) -m lipstream.cli.demo

# the example newsroom show (examples/newsroom/show.yaml): every layer, a text scene, a music bed
show: $(call stamp,demo) espeak
	$(PY) -m lipstream.cli.demo --show

# tests/test_serve_page.py drives a real Chromium (Debian's package; Playwright's own download is not used):
# installed here when missing and apt-get can run as root; without it that test skips
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then sudo=; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else sudo=no; fi; \
	  if [ "$$sudo" != no ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the page test"; \
	    apt="$$sudo env DEBIAN_FRONTEND=noninteractive apt-get -y -qq"; \
	    $$apt install --no-install-recommends chromium >/dev/null 2>&1 || \
	    { $$apt update && $$apt install --no-install-recommends chromium >/dev/null; }; \
	  fi; \
	  command -v chromium >/dev/null 2>&1 || echo "no chromium (apt-get as root could not install it): the page test will skip"; }

# tests/test_serve_store.py runs the store tests on a real PostgreSQL (Debian's package, started by the test
# as the postgres user): installed here when missing and apt-get can run as root; without it that half skips
postgres:
	@{ command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; } || { \
	  if [ "$$(id -u)" = 0 ]; then sudo=; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else sudo=no; fi; \
	  if [ "$$sudo" != no ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's postgresql for the job store tests"; \
	    apt="$$sudo env DEBIAN_FRONTEND=noninteractive apt-get -y -qq"; \
	    $$apt install --no-install-recommends postgresql >/dev/null 2>&1 || \
	    { $$apt update && $$apt install --no-install-recommends postgresql >/dev/null; }; \
	  fi; \
	  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || echo "no PostgreSQL (apt-get as root could not install it): its store tests will skip"; }

# text scenes of `lipstream broadcast` are spoken by espeak-ng (Debian's package) unless a Piper voice is named;
# tests/test_show_tts.py runs it: installed here when missing and apt-get can run as root; without it those tests skip
espeak:
	@command -v espeak-ng >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then sudo=; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else sudo=no; fi; \
	  if [ "$$sudo" != no ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's espeak-ng for text scenes"; \
	    apt="$$sudo env DEBIAN_FRONTEND=noninteractive apt-get -y -qq"; \
	    $$apt install --no-install-recommends espeak-ng >/dev/null 2>&1 || \
	    { $$apt update && $$apt install --no-install-recommends espeak-ng >/dev/null; }; \
	  fi; \
	  command -v espeak-ng >/dev/null 2>&1 || echo "no espeak-ng (apt-get as root could not install it): the TTS tests will skip"; }

# the quick tier (a contributor's loop before each commit, <= 4 minutes on 2 cores): every package's own
# tests, the slow ones (marked `slow`: builds, servers, browsers, long renders) left to `make test`.
# OMP_WAIT_POLICY=PASSIVE: torch's idle CPU threads sleep instead of spinning; beside another busy process
# on 2 cores the spinning made tests/test_decode.py take 99 s instead of 11 s
check: $(call stamp,check)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -m "not slow"

# everything (CI: .ci/run)
test: $(call stamp,test) browser postgres espeak
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) demo-out .pytest_cache
