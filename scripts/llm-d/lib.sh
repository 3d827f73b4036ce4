# Shared by the scripts that build llm-d's Go programs (scripts/llm-d/build-pd-sidecar.sh,
# scripts/llm-d-sim/build-sim.sh): the Go settings, the checks, a git tree laid out once per
# commit, and a build cache keyed by commit. Source it; it defines functions only.
#
# Every build: CGO off, this machine's Go toolchain (no toolchain download), modules from the
# module proxy as go.mod asks (-mod=mod), into ~/.cache/pdpool/ (outside the repository).

export GOFLAGS="-mod=mod -buildvcs=false" GOTOOLCHAIN=local CGO_ENABLED=0

# llmd_require NAME GIT_DIR: one line and exit 3 when go or the fetched git tree is missing.
llmd_require() {
  local name=$1 git_dir=$2
  command -v go >/dev/null || { echo "$name: go is not installed" >&2; exit 3; }
  git --git-dir="$git_dir" rev-parse --verify -q HEAD >/dev/null 2>&1 || {
    echo "$name: no llm-d source at $git_dir (a git dir; fetch the repository first)" >&2
    exit 3
  }
}

# llmd_commit GIT_DIR REF: the commit REF names, or one line and exit 3.
llmd_commit() {
  git --git-dir="$1" rev-parse --verify -q "$2^{commit}" || {
    echo "llm-d: $2 is not a commit of $1" >&2
    exit 3
  }
}

# llmd_tree GIT_DIR COMMIT DEST: the commit's files in DEST (laid out once).
llmd_tree() {
  local git_dir=$1 commit=$2 dest=$3
  if [[ ! -f $dest/go.mod ]]; then
    rm -rf "$dest.part" && mkdir -p "$dest.part"
    git --git-dir="$git_dir" archive "$commit" | tar -x -C "$dest.part"
    mv "$dest.part" "$dest"
  fi
}

# llmd_module_tree MODULE VERSION DEST: the module's files from the Go module proxy in DEST
# (a writable copy: the module cache is read-only, and -mod=mod may touch go.mod).
llmd_module_tree() {
  local module=$1 version=$2 dest=$3 dir
  if [[ ! -f $dest/go.mod ]]; then
    command -v go >/dev/null || { echo "llm-d: go is not installed" >&2; exit 3; }
    dir=$(go mod download -json "$module@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
    [[ -n $dir && -f $dir/go.mod ]] || {
      echo "llm-d: the Go module proxy did not serve $module@$version" >&2
      exit 3
    }
    rm -rf "$dest.part" && cp -r "$dir" "$dest.part" && chmod -R u+w "$dest.part"
    mv "$dest.part" "$dest"
  fi
}

# llmd_cached BIN_DIR NAME COMMIT: true (and prints the path) when BIN_DIR/NAME was built
# from COMMIT.
llmd_cached() {
  local bin=$1/$2
  if [[ -x $bin && "$(cat "$1/.$2.version" 2>/dev/null)" == "$3" ]]; then
    echo "$bin"
    return 0
  fi
  return 1
}

# llmd_install BIN_DIR NAME COMMIT: moves BIN_DIR/NAME.new in place, records the commit,
# prints the path.
llmd_install() {
  mv "$1/$2.new" "$1/$2"
  echo "$3" >"$1/.$2.version"
  echo "$1/$2"
}
