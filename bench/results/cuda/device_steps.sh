# Sourced by the device scripts (from the repo root, after install_mlx_cuda.sh): the log, and
# step NAME MIN_SECONDS_LEFT CMD..., which runs CMD once per warm machine (a .done file), only
# when the call has MIN_SECONDS_LEFT of LIMIT left, stdout to $R/NAME; ONLY="a b": just these.
R=/root/res; mkdir -p $R
LIMIT=${LIMIT:-570}
step() {
  local name=$1 need=$2; shift 2
  [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]] && return
  [ -f $R/$name.done ] && { echo "== $name: done earlier"; return; }
  [ $((LIMIT - SECONDS)) -lt $need ] && { echo "== $name: skipped"; return; }
  echo "== $name ($(date +%T), $((LIMIT - SECONDS))s left): $*"
  local t0=$SECONDS
  timeout $((LIMIT - SECONDS - 10)) "$@" > $R/$name.tmp; local rc=$?
  mv $R/$name.tmp $R/$name; echo "== $name rc=$rc in $((SECONDS - t0))s"
  [ $rc -le 1 ] && [ -s $R/$name ] && touch $R/$name.done
}
