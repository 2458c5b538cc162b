#!/usr/bin/env bash
# Where an image's bytes are: its layers, then the largest folders and packages inside it (MB).
#   scripts/image/breakdown.sh [IMAGE]     (default embedserve:0.1.0)
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/image/engine.sh
image="${1:-${IMAGE:-embedserve:0.1.0}}"

echo "== $image: $(( $(engine image inspect --format '{{.Size}}' "$image") / 1000000 )) MB; its layers, newest first"
engine history --format '{{.Size}}\t{{.CreatedBy}}' "$image" | grep -v '^0 B' | cut -c1-110
# shellcheck disable=SC2016
engine run $RUN_FLAGS --rm --network=none --user 0 --env PYTHONDONTWRITEBYTECODE=1 --entrypoint sh "$image" -c '
  site=$(python -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec(\"torch\").submodule_search_locations[0]))")
  mb() { du -xsm "$@" 2>/dev/null | sort -rn; }
  echo "== folders"; du -xm -d2 / 2>/dev/null | sort -rn | awk "\$1 >= 5" | head -n 12
  echo "== Python packages ($site)"; mb "$site"/* | head -n 15
  echo "== the Java runtime"; for java in /opt/java /usr/lib/jvm; do [ -d "$java" ] && mb "$java"; done
  echo "== Python bytecode caches"
  find / -xdev -name "*.pyc" -printf "%s\n" 2>/dev/null | awk "{ s += \$1 } END { printf \"%d MB in %d files\n\", s / 1e6, NR }"
  echo "== Debian packages (installed size, MB)"
  dpkg-query -W -f="\${Installed-Size}\t\${Package}\n" | sort -rn | head -n 8 | awk "{ printf \"%d\t%s\n\", \$1 / 1024, \$2 }"'
