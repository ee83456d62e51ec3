"""One against two torch threads for ``pyrobdl.fit`` (mean-field), interleaved; CPU and wall time.

The measurement behind ``fit(threads="auto")`` (docs/benchmarks/svi.md, "Threads").

Usage::

    python comparisons/benchmarks/svi_threads.py [REPEATS]      # default 3
"""
import torch, time, statistics, pyrobdl, sys
cases = {
 "1x50, B=32, N=1000": (8,(50,),1,1000,32, 600),
 "1x50, full, N=1000": (8,(50,),1,1000,None, 300),
 "2x400, B=128, N=6000 (MNIST-sized)": (784,(400,400),10,6000,128, 60),
 "2x400, full, N=2000": (784,(400,400),10,2000,None, 10),
}
torch.manual_seed(0)
res = {}
for r in range(int(sys.argv[1]) if len(sys.argv)>1 else 3):
    for name,(d,h,o,n,b,steps) in cases.items():
        x=torch.randn(n,d)
        if o==10:
            y=torch.randint(10,(n,)); lik=pyrobdl.likelihoods.Categorical()
        else:
            y=torch.randn(n); lik=pyrobdl.likelihoods.Gaussian(1.0)
        for th in (1,2):
            m=pyrobdl.BayesianMLP(d,h,o,likelihood=lik)
            w=time.perf_counter(); c=time.process_time()
            pyrobdl.fit(m,x,y,"mean_field",num_steps=steps,batch_size=b,progress=False,threads=th)
            res.setdefault((name,th),[]).append(((time.perf_counter()-w)/steps*1e3,(time.process_time()-c)/steps*1e3))
print("| case | 1 thread: wall ms/step | CPU ms/step | 2 threads: wall ms/step | CPU ms/step | wall ratio 2/1 |")
print("|---|---|---|---|---|---|")
for name in cases:
    w1=statistics.median(v[0] for v in res[(name,1)]); c1=statistics.median(v[1] for v in res[(name,1)])
    w2=statistics.median(v[0] for v in res[(name,2)]); c2=statistics.median(v[1] for v in res[(name,2)])
    print(f"| {name} | {w1:.3f} | {c1:.3f} | {w2:.3f} | {c2:.3f} | {w2/w1:.2f}x |")
