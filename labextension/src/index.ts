import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Widget } from '@lumino/widgets';

import { IArtifact } from './api';
import { GpuLeaseModel } from './model';
import { LeaseNotifier } from './notify';
import { GpuLeasePanel, PANEL_ID } from './panel';

const OPEN_COMMAND = 'gpulease:open-panel';
const DESKTOP_COMMAND = 'gpulease:allow-desktop-notifications';

/** The status-bar item: "GPUs 3/4 free"; click or Enter opens the panel. */
class StatusItem extends Widget {
  constructor(
    private model: GpuLeaseModel,
    open: () => void
  ) {
    super({ node: document.createElement('button') });
    this.addClass('jp-GpuLease-statusItem');
    this.node.setAttribute('type', 'button');
    this.node.addEventListener('click', open);
    model.changed.connect(() => this.update(), this);
    this.update();
  }

  protected onUpdateRequest(): void {
    const m = this.model;
    let text = 'GPUs …';
    if (m.connection === 'unreachable') {
      text = 'GPUs: broker unreachable';
    } else if (m.info) {
      text = `GPUs ${m.info.summary.free}/${m.info.summary.total} free`;
    }
    this.node.textContent = text;
    this.node.setAttribute('aria-label', `${text}: open the GPU lease panel`);
    this.node.title = 'Open the GPU lease panel';
  }
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-gpulease:plugin',
  description: 'GPUs, queue, leases and artifacts of the GPU lease broker, in the left sidebar',
  autoStart: true,
  optional: [ILabShell, IStatusBar, ISettingRegistry, ICommandPalette, ILayoutRestorer],
  activate: (
    app: JupyterFrontEnd,
    labShell: ILabShell | null,
    statusBar: IStatusBar | null,
    settingRegistry: ISettingRegistry | null,
    palette: ICommandPalette | null,
    restorer: ILayoutRestorer | null
  ) => {
    const model = new GpuLeaseModel();

    const openArtifact = (a: IArtifact) => {
      if (a.relative_path === null) {
        return;
      }
      const log = a.files.includes('output.log') ? `${a.relative_path}/output.log` : null;
      void app.commands.execute('filebrowser:go-to-path', { path: a.relative_path });
      if (log) {
        void app.commands.execute('docmanager:open', { path: log });
      }
    };

    const panel = new GpuLeasePanel(model, openArtifact);
    app.shell.add(panel, 'left', { rank: 800 });
    // the workspace remembers whether the panel was open (`make demo` writes one with it open)
    restorer?.add(panel, PANEL_ID);

    app.commands.addCommand(OPEN_COMMAND, {
      label: 'Show GPU leases',
      execute: () => app.shell.activateById(PANEL_ID)
    });

    if (statusBar) {
      statusBar.registerStatusItem('jupyter-gpulease:status', {
        item: new StatusItem(model, () => void app.commands.execute(OPEN_COMMAND)),
        align: 'left',
        rank: 50
      });
    }

    // Notifications about your own leases (granted, background cell ended, warnings, revocations)
    const notifier = new LeaseNotifier(app, model, () => void app.commands.execute(OPEN_COMMAND));
    if (settingRegistry) {
      notifier.followSettings(settingRegistry, plugin.id).catch(error => {
        console.warn('jupyter-gpulease: settings not loaded, every notification is on', error);
      });
      // the panel open at start (the demo's choice): once the workspace's layout is restored, or it would win
      Promise.all([settingRegistry.load(plugin.id), app.restored])
        .then(([settings]) => {
          if (settings.get('openAtStart').composite === true) {
            app.shell.activateById(PANEL_ID);
          }
        })
        .catch(error => console.warn('jupyter-gpulease: the GPU panel is not opened at start', error));
    }
    app.commands.addCommand(DESKTOP_COMMAND, {
      label: 'Allow GPU lease desktop notifications',
      caption: 'Ask the browser to show GPU lease notifications on the desktop while this tab is hidden',
      execute: () => notifier.desktop.request()
    });
    if (palette) {
      palette.addItem({ command: DESKTOP_COMMAND, category: 'GPU leases' });
      palette.addItem({ command: OPEN_COMMAND, category: 'GPU leases' });
    }

    model.start();
  }
};

export default plugin;
