# Worker image for `tokenmill curate` and `tokenmill tokenize` on Dataflow (or any portable runner):
# Beam's Python SDK image of the launcher's Beam version, plus tokenmill's curate-only install. It holds
# no jax, optax or orbax-checkpoint (the `train` extra: workers never run the trainer) and has gcsfs for
# gs://. Workers then start in seconds instead of pip-installing tokenmill and its dependencies each.
#
# Build it from the repository root and push it where the workers can pull it:
#   docker build -f docker/curate.Dockerfile -t REGION-docker.pkg.dev/PROJECT/REPO/tokenmill-curate:TAG .
#   docker push REGION-docker.pkg.dev/PROJECT/REPO/tokenmill-curate:TAG
# and launch with it (no package is shipped then; rebuild the image when tokenmill changes):
#   tokenmill curate ... --runner dataflow --sdk_container_image REGION-docker.pkg.dev/PROJECT/REPO/tokenmill-curate:TAG
#
# PYTHON_VERSION and BEAM_VERSION must be the launcher's (python -V; python -c "import apache_beam as b;
# print(b.__version__)"): Dataflow refuses an SDK container whose Beam differs from the launcher's, and
# pickled pipeline code needs the same Python. tests/test_runners.py checks BEAM_VERSION against the
# installed Beam. Override both with --build-arg.
ARG PYTHON_VERSION=3.11
ARG BEAM_VERSION=2.77.0
FROM apache/beam_python${PYTHON_VERSION}_sdk:${BEAM_VERSION}
ARG BEAM_VERSION

WORKDIR /opt/tokenmill
COPY pyproject.toml setup.py README.md ./
COPY src ./src
# apache-beam stays pinned to the image's own version: the image's boot program expects that SDK.
# The checks: no trainer in the image, and every module a curate or tokenize stage may load imports
# (everything but the trainer and the Dask runner, the `train` and `dask` extras); tests/test_clean_install.py
# runs every shipped recipe on an install of these same files.
RUN pip install --no-cache-dir ".[dataflow]" gcsfs "apache-beam[gcp]==${BEAM_VERSION}" \
    && pip check \
    && python -c "import importlib.util as u; extra = [m for m in ('jax', 'optax', 'orbax') if u.find_spec(m)]; assert not extra, extra" \
    && python -c "import sys, tokenmill.pipelines.curate, tokenmill.pipelines.tokenize; assert 'jax' not in sys.modules" \
    && python -c "import importlib, pkgutil, tokenmill; [importlib.import_module(m.name) for m in pkgutil.walk_packages(tokenmill.__path__, 'tokenmill.') if m.name != 'tokenmill.__main__' and not m.name.startswith(('tokenmill.trainer', 'tokenmill.pipelines.dask_runner'))]"
# The entrypoint stays the SDK image's own (/opt/apache/beam/boot), which the runners start.
