# one device call: the one-GPU split cost again (tools/bench_zero_bubble.py --single-gpu), after a run of
# the new code measured the graphed split at seq 512 at 22.7 ms in one process and 19.1 in another
# (old code 18.6 / 19.0): new, old, new, new; plus the cost of one weight-pass check (stack search)
# .gl/oldtree: mkdir -p .gl/oldtree && git archive d788551 paddle_graphpp tools | tar x -C .gl/oldtree (run with carry [".gl/oldtree"])
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"; nproc; uptime; } > $R/env.txt
for tag in new-3 old-3 new-4 new-5; do
  case $tag in old*) (cd .gl/oldtree && PYTHONPATH=$PWD timeout 200 python tools/bench_zero_bubble.py --single-gpu --seq 512 --name $tag > $R/$tag.txt 2>&1);;
               *) PYTHONPATH=$PWD timeout 200 python tools/bench_zero_bubble.py --single-gpu --seq 512 --name $tag > $R/$tag.txt 2>&1;; esac
  python -c "
import json,glob
d=json.load(open(glob.glob('$OUT/$tag-split-*.json')[0]))['results']
for s,e in d.items(): print('$tag', s, {k: (round(v['median_ms'],1), round(v['min_ms'],1), round(v['max_ms'],1)) for k,v in e['timings_ms'].items()})
"
done
PYTHONPATH=$PWD python -c "
import timeit
from paddle_graphpp.torch.split_backward import in_pipelining_weight_pass
n=2000; t=timeit.timeit(in_pipelining_weight_pass, number=n)/n
print('in_pipelining_weight_pass: %.1f us per call' % (t*1e6))
"
cat $R/env.txt
tar czf $OUT/run.tgz -C $R .
